"""Copy back what ``dist_checkpointing.load`` loaded into new storage.

A sharded state dict is a tree of dicts and lists whose leaves are Megatron-Core ``ShardedBase``
objects (and plain values). ``load`` returns a tree of the same shape with loaded values in
place of the sharded leaves. For a ``ShardedTensor`` the loaded tensor normally *is* the
tensor the entry was built from (``data``: the parameter, or a view of it), filled in place; for
a ``ShardedTensorFactory`` it is whatever the factory's merge function built -- new storage.
:func:`entry_targets` records the entries' tensors before the load (``load`` replaces
factories in the caller's tree); :func:`copy_back` copies every loaded tensor that lives in
other storage into its entry's tensor. Torch and Megatron-Core are imported inside the
functions (both are imported already whenever these run).
"""

from __future__ import annotations

from typing import Any, Iterator

Path = tuple  # keys / list indices from the root of a state dict


class ExpertReloadError(RuntimeError):
    """A loaded tensor cannot be copied into the tensor its sharded-state-dict entry was built from."""


def _leaves(tree: Any, path: Path = ()) -> Iterator[tuple[Path, Any]]:
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _leaves(value, path + (key,))
    elif isinstance(tree, list):
        for index, value in enumerate(tree):
            yield from _leaves(value, path + (index,))
    else:
        yield path, tree


def _at(tree: Any, path: Path) -> Any:
    for step in path:
        if isinstance(tree, dict) and step in tree:
            tree = tree[step]
        elif isinstance(tree, list) and isinstance(step, int) and step < len(tree):
            tree = tree[step]
        else:
            return None
    return tree


def entry_targets(sharded_state_dict: Any) -> dict[Path, tuple[str, Any]]:
    """``path -> (checkpoint key, tensor the entry was built from)`` for every ``ShardedTensor``
    and ``ShardedTensorFactory`` leaf whose ``data`` is a tensor."""
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    return {path: (leaf.key, leaf.data) for path, leaf in _leaves(sharded_state_dict)
            if isinstance(leaf, (ShardedTensor, ShardedTensorFactory)) and torch.is_tensor(leaf.data)}


def same_storage(a, b) -> bool:
    """Whether two tensors share memory (a view and its base do)."""
    if a is b:
        return True
    try:
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor subclass without storage: not shared
        return False


def copy_back(targets: dict[Path, tuple[str, Any]], loaded: Any) -> list[str]:
    """Copy each loaded tensor that is not in its target's storage into the target, in place.

    Returns the checkpoint keys copied. Raises :class:`ExpertReloadError` (naming the key) when a
    loaded tensor's shape or dtype differs from its target's: nothing is cast or reshaped."""
    import torch
    problems, pending = [], []
    for path, (key, target) in targets.items():
        value = _at(loaded, path)
        if not torch.is_tensor(value) or same_storage(value, target):
            continue
        if value.shape != target.shape or value.dtype != target.dtype:
            problems.append(f"{key} (state dict entry {'.'.join(map(str, path))}): loaded "
                            f"{value.dtype}{list(value.shape)}, parameter {target.dtype}{list(target.shape)}")
            continue
        pending.append((key, target, value))
    if problems:
        raise ExpertReloadError(
            "ascend-rl dist_ckpt_expert_reload: cannot copy loaded tensors back into the model (set "
            "ASCEND_RL_DIST_CKPT_EXPERT_RELOAD=0 to leave them unloaded): " + "; ".join(problems))
    with torch.no_grad():
        for _, target, value in pending:
            target.copy_(value)
    return [key for key, _, _ in pending]
