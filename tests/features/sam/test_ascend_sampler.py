"""vLLM-Ascend's PyTorch rejection sampler, read from the real sources of both stacks.

vLLM-Ascend cannot be imported here (torch_npu), so its sampler functions are compiled
from the unpacked source into a namespace with torch (``pin_memory=True`` rewritten to
False: there is no pinned memory without an accelerator; nothing else is changed) and run
side by side with this project's replacement of the one branch that still loops.
"""

from __future__ import annotations

import ast

import pytest

torch = pytest.importorskip("torch")

from ascend_rl_plugins.features import sam as feature  # noqa: E402
from ascend_rl_plugins.features.sam import ascend_sampler  # noqa: E402
from ascend_rl_plugins.patching.core import REGISTRY  # noqa: E402
from tests.features.upstream_source import STACKS, module_path, parse, top_level  # noqa: E402

MODULE = "vllm_ascend.sample.rejection_sampler"
VECTORIZED = ("rejection_greedy_sample_pytorch", "rejection_random_sample_pytorch",
              "expand_pytorch", "rejection_random_sample_block_verify_pytorch")
LOOPING = ("sample_recovered_tokens_pytorch", "sample_recovered_tokens_blockwise_pytorch")


class _NoPinnedMemory(ast.NodeTransformer):
    def visit_keyword(self, node):
        if node.arg == "pin_memory":
            return ast.keyword(arg="pin_memory", value=ast.Constant(False))
        return node


def _upstream(stack: str, names) -> dict:
    tree = parse(module_path(stack, "vllm_ascend", MODULE))
    body = [_NoPinnedMemory().visit(top_level(tree, n)) for n in names]
    module = ast.fix_missing_locations(ast.Module(body=body, type_ignores=[]))
    ns = {"torch": torch, "PLACEHOLDER_TOKEN_ID": ascend_sampler.PLACEHOLDER}
    exec(compile(module, f"<{stack} {MODULE}>", "exec"), ns)
    return ns


def _loops(node) -> list[int]:
    return [n.lineno for n in ast.walk(node) if isinstance(n, (ast.For, ast.While))]


@pytest.mark.parametrize("stack", STACKS)
def test_upstream_sampler_is_already_vectorized_except_the_patched_branch(stack):
    """The Qwen3 RL recipe vectorized vLLM-Ascend's loop-based rejection sampler; both supported
    versions now ship that themselves. What still loops per draft token is the reduce-
    sampling branch of the recovered-token samplers in 0.23 (patched); 0.13 has no reduce
    sampling."""
    tree = parse(module_path(stack, "vllm_ascend", MODULE))
    for name in VECTORIZED:
        assert _loops(top_level(tree, name)) == [], (stack, name)
    if stack == "recipe":
        node = top_level(tree, "sample_recovered_tokens_pytorch")
        assert "enable_reduce_sampling" not in [a.arg for a in node.args.args]
        assert _loops(node) == []
        return
    for name in LOOPING:
        node = top_level(tree, name)
        params = [a.arg for a in node.args.args]
        assert params == list(feature._RECOVERED_PARAMS), (name, params)
        assert _loops(node), f"{name} no longer loops: the patch can go"


def _case(seed: int, *, batch: int, spec: int, cand: int, vocab: int):
    g = torch.Generator().manual_seed(seed)
    n_draft = torch.randint(0, spec + 1, (batch,), generator=g)
    n_draft[0] = spec  # at least one full block
    cu = torch.cumsum(n_draft, 0)
    n = int(cu[-1])
    indices = torch.stack([torch.randperm(vocab, generator=g)[:cand] for _ in range(n)])
    draft = torch.randint(0, vocab, (n,), generator=g)
    among = torch.rand(n, generator=g) < 0.6  # most drafts are among the candidates
    slot = torch.randint(0, cand, (n,), generator=g)
    draft = torch.where(among, indices[torch.arange(n), slot], draft)
    draft[torch.rand(n, generator=g) < 0.1] = ascend_sampler.PLACEHOLDER
    probs = torch.softmax(torch.randn(n, cand, generator=g) * 3, dim=1)
    q = torch.empty(batch, cand).exponential_(generator=g)
    q[torch.rand(batch, cand, generator=g) < 0.05] = 0.0
    q[torch.rand(batch, cand, generator=g) < 0.05] = float("inf")
    return cu, draft, probs, q, indices


@pytest.mark.parametrize("blockwise", [False, True], ids=["plain", "block-verify"])
@pytest.mark.parametrize("seed", range(6))
def test_replacement_equals_upstream_bit_for_bit(blockwise, seed):
    name = LOOPING[1] if blockwise else LOOPING[0]
    upstream = _upstream("current", [name])[name]
    ours = (ascend_sampler.recovered_tokens_ngram_reduced_blockwise if blockwise
            else ascend_sampler.recovered_tokens_ngram_reduced)
    cu, draft, probs, q, indices = _case(seed, batch=5, spec=4, cand=16, vocab=50)
    want = torch.empty_like(draft)
    upstream(want, cu, draft, None, probs, q, 16, IS_NGRAM=True, target_indices=indices,
             enable_reduce_sampling=True)
    got = torch.full_like(draft, -7)
    ours(got, cu, draft, probs, q, indices)
    assert torch.equal(got, want)


def test_patch_routes_only_the_looping_branch():
    calls = []

    def upstream(*args, **kwargs):
        calls.append(kwargs)

    cu, draft, probs, q, indices = _case(0, batch=3, spec=3, cand=8, vocab=20)
    out = torch.empty_like(draft)
    for name in ("sam.ascend_vectorized_recovered_tokens",
                 "sam.ascend_vectorized_recovered_tokens_blockwise"):
        patch = REGISTRY.patches[name].impl
        calls.clear()
        patch(upstream, None, (out, cu, draft, None, probs, q, 8),
              {"IS_NGRAM": True, "target_indices": indices, "enable_reduce_sampling": True})
        assert calls == []  # ours ran
        patch(upstream, None, (out, cu, draft, None, probs, q, 8),
              {"IS_NGRAM": True, "target_indices": None, "enable_reduce_sampling": False})
        patch(upstream, None, (out, cu, draft, probs, probs, q, 8),
              {"IS_NGRAM": False, "target_indices": indices, "enable_reduce_sampling": True})
        assert len(calls) == 2  # everything else is upstream's
