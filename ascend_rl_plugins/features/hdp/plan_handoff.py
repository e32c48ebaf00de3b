"""How a micro-batch formed by the HDP planner hands its plan to the packed-sequence wrappers.

:mod:`.microbatch` forms the micro-batches and writes the plan two ways: as an attribute of the
micro-batch's attention-mask tensor (:func:`attach_plan`), and under the rows' lengths
(:func:`remember`) for when verl copies the tensor to the device and the attribute is lost.
:mod:`.verl_packing` reads them back (``PLAN_ATTRIBUTE``, :func:`recall`). Why a module of its
own: the writer and the reader both import it, and neither has to import the other.
"""

from __future__ import annotations

from collections import OrderedDict

PLAN_ATTRIBUTE = "_ascend_rl_hdp_plan"

_MEMO: "OrderedDict[tuple, tuple]" = OrderedDict()
_MEMO_SIZE = 4096


def attach_plan(attention_mask, micro_batch_plan) -> None:
    """Attach a planner ``MicroBatchPlan`` to a micro-batch's attention-mask tensor."""
    setattr(attention_mask, PLAN_ATTRIBUTE, micro_batch_plan)


def remember(lengths: tuple[int, ...], cp_size: int, tp: int, groups, group_of) -> None:
    """Remember a micro-batch's grouping under its rows' lengths (the last ``_MEMO_SIZE``)."""
    _MEMO[(tuple(lengths), cp_size, tp)] = (tuple(tuple(g) for g in groups), tuple(group_of))
    _MEMO.move_to_end((tuple(lengths), cp_size, tp))
    while len(_MEMO) > _MEMO_SIZE:
        _MEMO.popitem(last=False)


def recall(lengths: tuple[int, ...], cp_size: int, tp: int):
    """``(groups, group_of)`` remembered for rows of these lengths, or None."""
    return _MEMO.get((tuple(lengths), cp_size, tp))
