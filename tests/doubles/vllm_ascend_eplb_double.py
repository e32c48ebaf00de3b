"""Doubles of the vLLM-Ascend objects the EPLB lifecycle touches (0.13 and 0.23 flavours).

Each class keeps the constructor/method signatures of the real one (test_eplb.py checks
them against both vLLM-Ascend sources with the AST) and only the behaviour the lifecycle
observes: processes that can be alive or terminated, an updator with its iteration
counters, MoE layers with placement tensors and load counters, an NPU worker whose
``wake_up`` replaces the MoE weight parameters as the real one does. Every call is
appended to a shared ``events`` list so tests can assert ordering.
"""

from __future__ import annotations

import torch

EVENTS: list = []


class ProcessDouble:
    """multiprocessing.Process as returned by ``EplbProcess._launch_process``."""

    def __init__(self):
        self.alive = True

    def is_alive(self):
        return self.alive

    def terminate(self):
        EVENTS.append("process.terminate")
        self.alive = False

    def join(self, timeout=None):
        EVENTS.append("process.join")


class EplbProcessDouble13:
    def __init__(self, shared_dict, policy_type: int = 0, enable_d2d: bool = True):
        self.shared_dict, self.policy_type, self.enable_d2d = shared_dict, policy_type, enable_d2d
        self.tp_size = None
        EVENTS.append("EplbProcess()")

    def _launch_process(self):
        EVENTS.append("EplbProcess._launch_process")
        return ProcessDouble()


class EplbProcessDouble23(EplbProcessDouble13):
    def __init__(self, shared_dict, policy_type: int = 0, enable_d2d: bool = True, tp_size: int | None = None):
        super().__init__(shared_dict, policy_type, enable_d2d)
        self.tp_size = tp_size


class D2DExpertWeightLoaderDouble:
    def __init__(self):
        self.eplb_adaptor = None

    def set_adator(self, eplb_adaptor):  # (sic) the upstream name
        self.eplb_adaptor = eplb_adaptor


class _UpdatorDoubleBase:
    def _init(self, loader, eplb_process, process):
        self.eplb_loader, self.eplb_process, self.process = loader, eplb_process, process
        self.shared_dict = eplb_process.shared_dict
        self.cur_iterations = 0
        self._gather_buffer = torch.zeros(4)
        EVENTS.append("EplbUpdator()")

    def set_adaptor(self, adaptor):
        self.adaptor = adaptor
        self.num_moe_layers = adaptor.num_moe_layers

    def warm_up_eplb(self):
        EVENTS.append("EplbUpdator.warm_up_eplb")
        self.shared_dict["expert_maps"] = self.adaptor.get_global_expert_map()
        self.loads_at_warm_up = [layer.moe_load.clone() for layer in moe_layer_list(self.adaptor)]

    def shutdown(self):
        EVENTS.append("EplbUpdator.shutdown")
        if self.process.is_alive():
            self.process.terminate()
            self.process.join()


class EplbUpdatorDouble13(_UpdatorDoubleBase):
    def __init__(self, ascend_config, loader, eplb_process, process):
        self.ascend_config = ascend_config
        self.num_iterations_eplb_update = ascend_config.num_iterations_eplb_update
        self.num_wait_worker_iterations = ascend_config.num_wait_worker_iterations
        self._init(loader, eplb_process, process)


class EplbUpdatorDouble23(_UpdatorDoubleBase):
    def __init__(self, eplb_config, loader, eplb_process, process):
        self.eplb_config = eplb_config
        self.expert_heat_collection_interval = eplb_config.expert_heat_collection_interval
        self.algorithm_execution_interval = eplb_config.algorithm_execution_interval
        self._init(loader, eplb_process, process)


class MoELayerDouble(torch.nn.Module):
    """The EPLB-relevant state of vLLM-Ascend's FusedMoE layer."""

    def __init__(self, ep_size: int, num_experts: int, rank: int):
        super().__init__()
        slots = num_experts // ep_size
        gmap = torch.full((ep_size, num_experts), -1, dtype=torch.int32)
        for expert in range(num_experts):
            gmap[expert // slots, expert] = expert % slots
        self.global_expert_map = gmap
        self._expert_map = gmap[rank].clone()
        self.log2phy = torch.arange(num_experts, dtype=torch.int32)
        self.moe_load = torch.zeros(slots, dtype=torch.int64)
        self.w13_weight = torch.nn.Parameter(torch.zeros(slots, 8, 4), requires_grad=False)
        self.w2_weight = torch.nn.Parameter(torch.zeros(slots, 4, 8), requires_grad=False)

    def get_log2phy_map(self):
        return self.log2phy

    def clear_moe_load(self):
        EVENTS.append("layer.clear_moe_load")
        self.moe_load.zero_()


def moe_layer_list(adaptor):
    return adaptor.moe_layers if hasattr(adaptor, "moe_layers") else [
        adaptor.model.model.layers[adaptor.num_dense_layers + i].mlp.experts for i in range(adaptor.num_moe_layers)]


class VllmEplbAdaptorDouble13:
    """0.13: walks ``model.model.layers[i].mlp.experts``; keeps views of expert params."""

    def __init__(self, model, **args):
        self.model = model
        self.num_dense_layers = 0
        self.num_moe_layers = len(model.model.layers)
        self.buffer_tensor_list = [[torch.empty(8)] for _ in range(2)]
        self.expert_param_per_layer = {i: [layer.mlp.experts.w13_weight, layer.mlp.experts.w2_weight]
                                       for i, layer in enumerate(model.model.layers)}
        EVENTS.append("VllmEplbAdaptor()")

    def get_global_expert_map(self):
        return torch.stack([layer.global_expert_map.cpu() for layer in moe_layer_list(self)])


class VllmEplbAdaptorDouble23(VllmEplbAdaptorDouble13):
    """0.23: keeps the registered MoE layers in ``moe_layers``."""

    def __init__(self, model, **args):
        super().__init__(model, **args)
        self.moe_layers = [layer.mlp.experts for layer in model.model.layers]


class _Block(torch.nn.Module):
    def __init__(self, experts):
        super().__init__()
        self.mlp = torch.nn.Module()
        self.mlp.experts = experts


class ModelDouble(torch.nn.Module):
    def __init__(self, num_layers=2, ep_size=2, num_experts=4, rank=0):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList(
            [_Block(MoELayerDouble(ep_size, num_experts, rank)) for _ in range(num_layers)])


class NPUModelRunnerDouble:
    """The EPLB attributes ``NPUModelRunner.__init__`` sets, and its ``eplb_warmup``."""

    def __init__(self, flavour: str, classes, adaptor_cls, tp_size=4):
        import types
        self.flavour = flavour
        self.model = ModelDouble()
        self.parallel_config = types.SimpleNamespace(tensor_parallel_size=tp_size)
        eplb_config = types.SimpleNamespace(expert_heat_collection_interval=10, algorithm_execution_interval=3,
                                            dynamic_eplb=True, eplb_policy_type=1)
        self.ascend_config = types.SimpleNamespace(num_iterations_eplb_update=10, num_wait_worker_iterations=3,
                                                   dynamic_eplb=True, eplb_config=eplb_config)
        self.adaptor_cls = adaptor_cls
        self.dynamic_eplb = True
        self.is_eplb_warmuped = False
        self.policy_type = 1
        self.eplb_loader = classes.D2DExpertWeightLoader()
        self.shared_dict = {"expert_map": None, "moe_load": None, "expert_maps": None}
        kwargs = {"tp_size": tp_size} if flavour == "va23" else {}
        self.eplb_process = classes.EplbProcess(shared_dict=self.shared_dict, policy_type=self.policy_type,
                                                enable_d2d=True, **kwargs)
        self.process = self.eplb_process._launch_process()
        config = eplb_config if flavour == "va23" else self.ascend_config
        self.eplb_updator = classes.EplbUpdator(config, self.eplb_loader, self.eplb_process, self.process)

    def eplb_warmup(self):
        if self.dynamic_eplb and not self.is_eplb_warmuped:
            self.is_eplb_warmuped = True
            self.eplb_adaptor = self.adaptor_cls(model=self.model)
            self.eplb_loader.set_adator(self.eplb_adaptor)
            self.eplb_updator.set_adaptor(self.eplb_adaptor)
            self.eplb_updator.warm_up_eplb()


class NPUWorkerDouble:
    """``NPUWorker.sleep(level)`` / ``wake_up(tags)``: allocator offload, and on weight
    wake-up the MoE weight transposes that replace the Parameter objects."""

    def __init__(self, model_runner):
        self.model_runner = model_runner

    def sleep(self, level: int = 1) -> None:
        EVENTS.append(f"allocator.sleep(level={level})")
        if level == 2:  # device memory discarded: placement tensors lose their content
            for layer in self.model_runner.model.model.layers:
                for name in ("global_expert_map", "_expert_map", "log2phy"):
                    getattr(layer.mlp.experts, name).fill_(-7)

    def wake_up(self, tags: list[str] | None = None) -> None:
        EVENTS.append(f"allocator.wake_up(tags={tags})")
        if tags is None or "weights" in tags:
            for layer in self.model_runner.model.model.layers:
                experts = layer.mlp.experts
                experts.w13_weight = torch.nn.Parameter(experts.w13_weight.transpose(1, 2), requires_grad=False)
                experts.w2_weight = torch.nn.Parameter(experts.w2_weight.transpose(1, 2), requires_grad=False)
            EVENTS.append("worker.transpose_moe_weights")
