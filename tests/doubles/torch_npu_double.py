"""torch_npu double: only ``torch_npu._C._distributed_c10d.ProcessGroupHCCL.Options``,
whose ``hccl_config`` dict is what vLLM-Ascend's ``create_hccl_pg_options`` fills in
(torch_npu docs: "通过pg_options配置HCCL通信域参数")."""

import types


class ProcessGroupHCCLOptionsDouble:
    """Mirrors ``ProcessGroupHCCL.Options()``: no constructor arguments, a ``hccl_config``
    attribute holding a dict of per-group HCCL settings."""

    def __init__(self):
        self.hccl_config = {}


def make_torch_npu_double() -> types.ModuleType:
    module = types.ModuleType("torch_npu")
    module.IS_ASCEND_RL_DOUBLE = True
    c10d = types.SimpleNamespace(ProcessGroupHCCL=types.SimpleNamespace(Options=ProcessGroupHCCLOptionsDouble))
    module._C = types.SimpleNamespace(_distributed_c10d=c10d)
    return module


class FusedInferAttentionScoreDouble:
    """``torch_npu.npu_fused_infer_attention_score``: only ``.out(**kwargs)``, recording
    the keyword arguments of each call (vLLM-Ascend passes everything by keyword)."""

    def __init__(self):
        self.calls = []

    def out(self, **kwargs):
        self.calls.append(kwargs)


class TorchNpuNamespaceDouble:
    """``torch.npu`` as used by graph parameter updates: ``stream(s)`` context manager,
    ``graph_task_update_begin(stream, handle)`` / ``graph_task_update_end(stream)``."""

    def __init__(self):
        self.updates = []

    def stream(self, stream):
        import contextlib
        return contextlib.nullcontext()

    def graph_task_update_begin(self, stream, handle):
        self.updates.append(("begin", handle))

    def graph_task_update_end(self, stream):
        self.updates.append(("end",))
