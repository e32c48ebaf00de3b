"""The reload machinery on a small model with an Ascend-style quant method (no engine, no NPU).

vLLM-Ascend's W8A8 / W8A8FP8 dynamic methods post-process *in place on the same Parameter
objects* (0.23 ``methods/w8a8_dynamic.py``: ``layer.weight.data = weight.transpose(0, 1)
.contiguous()``, scales and offsets flattened, ``weight_scale_fp32`` attached as a plain
tensor attribute) -- unlike vLLM's CPU kernel, which replaces the parameters. The method
below performs exactly those statements (``test_ascend_statements_are_the_real_ones`` checks
them against the real 0.23 source), so the reload's layout handling for Ascend (reuse of the
engine's Parameter objects, transposed storage kept, tensor attributes refreshed) runs here
on CPU. The model's ``load_weights`` mirrors vLLM's (name -> parameter map built once per
call, stacked q/k/v shards through the parameters' ``weight_loader``).
"""

import ast

import pytest

from tests.support import stacks

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase  # noqa: E402

from ascend_rl_plugins.features.flashrl import profile as P  # noqa: E402
from ascend_rl_plugins.features.flashrl import reload as R  # noqa: E402

SHARDS = {"q_proj": 24, "k_proj": 8, "v_proj": 8}
K = 16


class AscendStyleDynamic(QuantizeMethodBase):
    def __init__(self, act_quant_type=torch.int8):
        self.act_quant_type = act_quant_type

    def create_weights(self, *a, **k):
        raise NotImplementedError

    def apply(self, layer, x, bias=None):
        w = layer.weight.float() * layer.weight_scale_fp32.view(1, -1)
        return x.float() @ w

    def process_weights_after_loading(self, layer):  # the statements of vLLM-Ascend 0.23
        layer.weight.data = layer.weight.data.transpose(0, 1).contiguous()
        layer.weight_scale.data = layer.weight_scale.data.flatten()
        layer.weight_scale_fp32 = layer.weight_scale.data.to(torch.float32)
        layer.weight_offset.data = layer.weight_offset.data.flatten()


def _loader(sizes):
    offsets, o = {}, 0
    for shard, n in sizes.items():
        offsets[shard] = (o, n)
        o += n

    def weight_loader(param, loaded, shard_id=None):
        if shard_id is None:
            param.data.copy_(loaded)
        else:
            start, n = offsets[shard_id]
            param.data.narrow(0, start, n).copy_(loaded)
    return weight_loader


class Linear(torch.nn.Module):
    def __init__(self, sizes, dtype, act):
        super().__init__()
        n = sum(sizes.values())
        loader = _loader(sizes)
        for name, t in (("weight", torch.zeros(n, K, dtype=dtype)), ("weight_scale", torch.ones(n, 1)),
                        ("weight_offset", torch.zeros(n, 1, dtype=torch.bfloat16))):
            p = torch.nn.Parameter(t, requires_grad=False)
            p.weight_loader = loader
            self.register_parameter(name, p)
        self.quant_method = AscendStyleDynamic(act)


class Model(torch.nn.Module):
    packed_modules_mapping = {"qkv_proj": list(SHARDS)}

    def __init__(self, dtype, act, buffering=False):
        super().__init__()
        self.buffering = buffering
        layer = torch.nn.Module()
        layer.qkv_proj = Linear({s[0]: n for s, n in SHARDS.items()}, dtype, act)
        layer.o_proj = Linear({"o": 16}, dtype, act)
        layer.norm = torch.nn.Module()
        layer.norm.weight = torch.nn.Parameter(torch.ones(K, dtype=torch.bfloat16), requires_grad=False)
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([layer])

    def load_weights(self, weights):
        params = dict(self.named_parameters())  # once per call, as vLLM does
        if self.buffering:
            weights = list(weights)  # a loader that reads ahead: the reload must notice
        loaded = set()
        for name, t in weights:
            shard = None
            for s in SHARDS:
                if f".{s}." in name:
                    name, shard = name.replace(s, "qkv_proj"), s[0]
            if name.endswith("weight_offset") and name not in params:
                continue
            p = params[name]
            loader = getattr(p, "weight_loader", None)
            if loader is None:
                p.data.copy_(t)
            elif shard is None:
                loader(p, t)
            else:
                loader(p, t, shard)
            loaded.add(name)
        return loaded


def _hf(seed):
    g = torch.Generator().manual_seed(seed)
    out = [("model.layers.0.norm.weight", (torch.rand(K, generator=g) + 0.5).to(torch.bfloat16))]
    for s, n in SHARDS.items():
        out.append((f"model.layers.0.{s}.weight", torch.randn(n, K, generator=g).to(torch.bfloat16)))
    out.append(("model.layers.0.o_proj.weight", torch.randn(16, K, generator=g).to(torch.bfloat16)))
    return out


def _fn(dtype):
    return "int8" if dtype == torch.int8 else "fp8_channel"


def _engine(dtype, act, seed=0, **kw):
    """A model 'loaded' from the offline W8A8 of _hf(seed), post-processed, reload installed."""
    model = Model(dtype, act, **kw)
    quantized = list(P.OnlineQuantizer(P.Profile(), fn=_fn(dtype)).transform(_hf(seed)))
    state = R.ReloadState(model, None, torch.device("cpu"), None, _fn(dtype))
    model.buffering, buffering = False, model.buffering
    model.load_weights(quantized)
    before = state.record_before()
    for m in model.modules():
        if isinstance(getattr(m, "quant_method", None), QuantizeMethodBase):
            m.quant_method.process_weights_after_loading(m)
    state.record_after(before)
    R.install(model, state)
    model.buffering = buffering
    return model, state


def _snapshot(model):
    out = {n: p.detach().clone() for n, p in model.named_parameters()}
    for n, m in model.named_modules():
        if hasattr(m, "weight_scale_fp32"):
            out[n + ".weight_scale_fp32"] = m.weight_scale_fp32.clone()
    return out


def _same(a, b):
    def bits(t):
        return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
    return set(a) == set(b) and all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
                                    and torch.equal(bits(a[k]), bits(b[k])) for k in a)


PARAMS = [(torch.int8, torch.int8), (torch.float8_e4m3fn, torch.float8_e4m3fn)]


@pytest.mark.parametrize("dtype,act", PARAMS)
def test_reload_reuses_the_engines_parameter_objects_and_storage(dtype, act):
    model, state = _engine(dtype, act, seed=0)
    direct, _ = _engine(dtype, act, seed=1)
    assert all(r.rebuild and r.quantized for r in state.records.values())
    w = model.model.layers[0].qkv_proj.weight
    assert w.shape == (K, 40) and w.is_contiguous()  # transposed by the Ascend-style method
    objs = {n: (id(p), p.data_ptr()) for n, p in model.named_parameters()}
    fp32 = model.model.layers[0].qkv_proj.weight_scale_fp32.data_ptr()
    model.load_weights(_hf(1))
    assert {n: (id(p), p.data_ptr()) for n, p in model.named_parameters()} == objs
    assert model.model.layers[0].qkv_proj.weight_scale_fp32.data_ptr() == fp32
    assert _same(_snapshot(model), _snapshot(direct))
    assert state.last_stats["calls"] == 1 and state.last_stats["closed"] == 2


@pytest.mark.parametrize("dtype,act", PARAMS)
def test_sessions_complete_fused_layers_across_calls(dtype, act):
    model, state = _engine(dtype, act, seed=0)
    direct, _ = _engine(dtype, act, seed=1)
    before = _snapshot(model)
    update = _hf(1)
    split = [n for n, _ in update].index("model.layers.0.k_proj.weight")  # q in one call, k/v in the next
    with pytest.raises(R.ReloadError, match="only partly sent"):
        model.load_weights([t for t in update if ".q_proj." in t[0]])
    assert _same(_snapshot(model), before)  # refused, nothing changed
    with R.update_session(model):
        model.load_weights(update[:split])
        assert state.update is not None and state.update.pending  # qkv waits for k/v
        model.load_weights(update[split:])
    assert state.update is None and state.last_stats["spanned"] == ["model.layers.0.qkv_proj"]
    assert _same(_snapshot(model), _snapshot(direct))
    # an incomplete session is refused when it ends, and the layer keeps its weights
    again = _snapshot(model)
    with pytest.raises(R.ReloadError, match="only partly sent"):
        with R.update_session(model):
            model.load_weights([t for t in _hf(2) if ".q_proj." in t[0]])
    assert _same(_snapshot(model), again) and state.update is None


def test_a_loader_that_reads_ahead_is_detected_and_the_engine_left_intact():
    model, state = _engine(torch.int8, torch.int8, seed=0, buffering=True)
    before = _snapshot(model)
    with pytest.raises(R.ReloadError, match="tensor by tensor"):
        model.load_weights(_hf(1))
    assert _same(_snapshot(model), before)


def test_postprocess_failure_names_the_layer():
    model, state = _engine(torch.int8, torch.int8, seed=0)
    qm = model.model.layers[0].o_proj.quant_method

    def broken(layer):
        raise RuntimeError("boom")
    qm.process_weights_after_loading = broken
    with pytest.raises(R.ReloadError, match=r"post-processing of model\.layers\.0\.o_proj failed.*boom"):
        model.load_weights(_hf(1))


def test_reload_post_processes_under_the_engines_default_dtype():
    """vLLM's loader post-processes under ``set_default_torch_dtype(model dtype)`` and quant
    methods read it (vLLM's CPU int8 kernel: the oneDNN handler's output type, which for
    static activations is what the matmul writes into the bfloat16 output buffer). The
    reload reinstates it for every layer and restores torch's default, also on failure."""
    with R.default_dtype(torch.bfloat16):
        model, state = _engine(torch.int8, torch.int8, seed=0)
    assert state.default_dtype == torch.bfloat16 and torch.get_default_dtype() == torch.float32
    seen = []
    for m in (model.model.layers[0].qkv_proj, model.model.layers[0].o_proj):
        def recording(layer, original=m.quant_method.process_weights_after_loading):
            seen.append(torch.get_default_dtype())
            return original(layer)
        m.quant_method.process_weights_after_loading = recording
    model.load_weights(_hf(1))
    assert seen == [torch.bfloat16, torch.bfloat16] and torch.get_default_dtype() == torch.float32

    def broken(layer):
        raise RuntimeError("boom")
    model.model.layers[0].o_proj.quant_method.process_weights_after_loading = broken
    with pytest.raises(R.ReloadError, match="boom"):
        model.load_weights(_hf(2))
    assert torch.get_default_dtype() == torch.float32


def test_ascend_statements_are_the_real_ones():
    src = stacks.source("current", "vllm_ascend", "vllm_ascend", "quantization", "methods", "w8a8_dynamic.py")
    with open(src) as fh:
        tree = ast.parse(fh.read())
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "AscendW8A8DynamicLinearMethod")
    fn = next(i for i in cls.body if isinstance(i, ast.FunctionDef) and i.name == "process_weights_after_loading")
    real = ast.unparse(fn)
    for stmt in ("layer.weight.data = layer.weight.data.transpose(0, 1).contiguous()",
                 "layer.weight_scale.data = layer.weight_scale.data.flatten()",
                 "layer.weight_scale_fp32 = layer.weight_scale.data.to(torch.float32)",
                 "layer.weight_offset.data = layer.weight_offset.data.flatten()"):
        assert stmt in real, stmt
