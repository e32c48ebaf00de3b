"""The patch framework against real modules (stdlib, installed packages, vLLM when present).

Every test runs forked: the registry and the patched modules are process-global.
"""

import importlib
import logging
import sys
import textwrap
import zipfile

import pytest

from ascend_rl_plugins import flags
from ascend_rl_plugins.patching import REGISTRY, ConflictError, Feature, PatchError, Verified

pytestmark = pytest.mark.forked


def _feature(name="t"):
    return Feature(name, "test feature", verified=Verified())


def test_wrap_changes_behaviour_and_revert_restores_the_exact_object():
    original = textwrap.dedent
    f = _feature()
    calls = []

    @f.wrap("textwrap:dedent", dist=None, reason="test", remove_when="never")
    def shout(wrapped, instance, args, kwargs):
        calls.append(args)
        return wrapped(*args, **kwargs).upper()

    REGISTRY.activate()
    assert textwrap.dedent("  abc") == "ABC"
    assert calls == [("  abc",)]
    p = REGISTRY.patches["t.shout"]
    assert p.outcome.state == "applied" and p.original is original
    assert REGISTRY.revert(p)
    assert textwrap.dedent is original
    assert p.outcome.state == "reverted"


def test_apply_is_idempotent():
    f = _feature()
    count = []

    @f.wrap("textwrap:indent", dist=None, reason="test", remove_when="never")
    def counted(wrapped, instance, args, kwargs):
        count.append(1)
        return wrapped(*args, **kwargs)

    REGISTRY.activate()
    REGISTRY.activate()
    p = REGISTRY.patches["t.counted"]
    assert REGISTRY.apply(p) and REGISTRY.apply(p)
    textwrap.indent("x", " ")
    assert len(count) == 1


def test_from_import_copies_are_rebound_and_restored(tmp_path, monkeypatch):
    (tmp_path / "consumer_of_dedent.py").write_text("from textwrap import dedent\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    consumer = importlib.import_module("consumer_of_dedent")
    original = textwrap.dedent
    f = _feature()
    f.replace("textwrap:dedent", lambda text: "replaced", dist=None, reason="test", remove_when="never", name="t.repl")
    REGISTRY.activate()
    assert consumer.dedent("  x") == "replaced"
    REGISTRY.revert(REGISTRY.patches["t.repl"])
    assert consumer.dedent is original


def test_staticmethod_and_classmethod_kinds_survive_patching_and_revert():
    raw_static = vars(zipfile.CompleteDirs)["_implied_dirs"]
    raw_class = vars(zipfile.ZipInfo)["from_file"]
    f = _feature()

    @f.replace("zipfile:CompleteDirs._implied_dirs", dist=None, reason="test", remove_when="never")
    def implied(names):
        return ["only/"]

    @f.after("zipfile:ZipInfo.from_file", dist=None, reason="test", remove_when="never")
    def tag(result, instance, args, kwargs):
        result.comment = b"patched"
        return result

    REGISTRY.activate()
    assert isinstance(vars(zipfile.CompleteDirs)["_implied_dirs"], staticmethod)
    assert zipfile.CompleteDirs._implied_dirs(["a/b"]) == ["only/"]
    assert zipfile.ZipInfo.from_file(__file__).comment == b"patched"
    REGISTRY.revert_all()
    assert vars(zipfile.CompleteDirs)["_implied_dirs"] is raw_static
    assert vars(zipfile.ZipInfo)["from_file"] is raw_class


def test_inherited_method_is_patched_on_the_subclass_only_and_removed_on_revert():
    assert "open" not in vars(zipfile.PyZipFile)
    f = _feature()
    f.before("zipfile:PyZipFile.open", lambda instance, args, kwargs: None, dist=None, reason="test", remove_when="never",
             name="t.open")
    REGISTRY.activate()
    assert "open" in vars(zipfile.PyZipFile)
    assert vars(zipfile.ZipFile)["open"] is zipfile.ZipFile.__dict__["open"]
    REGISTRY.revert_all()
    assert "open" not in vars(zipfile.PyZipFile)


def test_before_can_rewrite_arguments_and_after_can_rewrite_results():
    import json
    f = _feature()
    f.before("json:loads", lambda instance, args, kwargs: (('{"a": 2}',), kwargs), dist=None,
             reason="test", remove_when="never", name="t.b")
    f.after("json:dumps", lambda result, instance, args, kwargs: result + "!", dist=None,
            reason="test", remove_when="never", name="t.a")
    REGISTRY.activate()
    assert json.loads('{"a": 1}') == {"a": 2}
    assert json.dumps(1) == "1!"


def test_two_replacements_of_one_target_conflict_naming_both():
    f = _feature()
    f.replace("textwrap:shorten", lambda *a, **k: "a", dist=None, reason="test", remove_when="never", name="t.first")
    with pytest.raises(ConflictError, match=r"t\.first.*t\.second"):
        f.replace("textwrap:shorten", lambda *a, **k: "b", dist=None, reason="test", remove_when="never", name="t.second")


def test_replacements_with_different_ranges_conflict_when_both_apply():
    f = _feature()
    f.replace("textwrap:shorten", lambda *a, **k: "a", dist="packaging", versions=">=1",
              reason="test", remove_when="never", name="t.first")
    f.replace("textwrap:shorten", lambda *a, **k: "b", dist="packaging", versions=">=2",
              reason="test", remove_when="never", name="t.second")
    with pytest.raises(ConflictError, match=r"t\.second and t\.first both replace"):
        REGISTRY.activate()


def test_wrappers_need_distinct_orders_and_compose_inner_to_outer():
    f = _feature()
    f.wrap("textwrap:fill", lambda w, i, a, k: "(" + w(*a, **k) + ")", dist=None, reason="t", remove_when="never",
           name="t.inner", order=1)
    f.wrap("textwrap:fill", lambda w, i, a, k: "[" + w(*a, **k) + "]", dist=None, reason="t", remove_when="never",
           name="t.outer", order=2)
    REGISTRY.activate()
    assert textwrap.fill("x") == "[(x)]"
    # reverting the inner one keeps the outer one working on the original
    REGISTRY.revert(REGISTRY.patches["t.inner"])
    assert textwrap.fill("x") == "[x]"
    f.wrap("textwrap:fill", lambda w, i, a, k: w(*a, **k), dist=None, reason="t", remove_when="never", name="t.noorder")
    with pytest.raises(ConflictError, match=r"t\.noorder and t\.outer both wrap"):
        REGISTRY.activate()


def test_lazy_application_waits_for_the_import():
    if "tabnanny" in sys.modules:
        pytest.skip("tabnanny already imported in this process")
    f = _feature()
    f.after("tabnanny:errprint", lambda result, i, a, k: "patched", dist=None, reason="t", remove_when="never",
            name="t.lazy")
    REGISTRY.activate()
    p = REGISTRY.patches["t.lazy"]
    assert p.outcome.state == "pending"
    assert "tabnanny" not in sys.modules  # activation did not import it
    import tabnanny
    assert p.outcome.state == "applied"
    assert tabnanny.errprint() == "patched"


def test_applying_a_pending_patch_by_hand_installs_it_once():
    """``apply`` on a pending patch imports its module, which runs the post-import hook that
    applies the patch; the explicit call must then find it applied, not wrap a second time."""
    if "tabnanny" in sys.modules:
        pytest.skip("tabnanny already imported in this process")
    f = _feature()
    f.after("tabnanny:errprint", lambda result, i, a, k: "patched", dist=None, reason="t",
            remove_when="never", name="t.pending_by_hand")
    REGISTRY.activate()
    p = REGISTRY.patches["t.pending_by_hand"]
    assert p.outcome.state == "pending"
    assert REGISTRY.apply(p)
    import tabnanny
    assert tabnanny.errprint() == "patched"
    assert not hasattr(tabnanny.errprint.__wrapped__, "__wrapped__"), "installed twice"
    assert REGISTRY.revert(p)
    assert not hasattr(tabnanny.errprint, "__wrapped__"), "a wrapper survived revert"


def test_version_gate_uses_the_installed_distribution():
    from importlib.metadata import version
    installed = version("packaging")
    f = _feature()
    f.after("textwrap:wrap", lambda r, i, a, k: r, dist="packaging", versions="<1", reason="t", remove_when="never",
            name="t.old")
    f.after("textwrap:wrap", lambda r, i, a, k: r, dist="packaging", versions="<1", reason="t", remove_when="never",
            name="t.fixed", fixed_upstream="packaging 1.0", order=1)
    f.after("textwrap:wrap", lambda r, i, a, k: r, dist="no-such-dist-xyz", reason="t", remove_when="never",
            name="t.absent", order=2)
    f.after("textwrap:wrap", lambda r, i, a, k: r, dist="packaging", versions=f"=={installed}",
            reason="t", remove_when="never", name="t.ok", order=3)
    REGISTRY.activate()
    st = {p.name: p.outcome for p in f.patches}
    assert st["t.old"].state == "skipped" and "outside supported range <1" in st["t.old"].reason
    assert "fixed upstream (packaging 1.0)" in st["t.fixed"].reason
    assert st["t.absent"].state == "skipped" and "not installed" in st["t.absent"].reason
    assert st["t.ok"].state == "applied"


def test_flag_gates_and_disable_list(monkeypatch):
    gate = flags.define("ASCEND_RL_TESTGATE", "bool", False, "test gate", feature="t")
    f = Feature("t", "test", flag=gate, verified=Verified())
    f.after("textwrap:wrap", lambda r, i, a, k: r, dist=None, reason="t", remove_when="never", name="t.gated")
    f.after("textwrap:fill", lambda r, i, a, k: r, dist=None, reason="t", remove_when="never", name="t.listed",
            enabled_by=lambda: True)
    monkeypatch.setenv("ASCEND_RL_DISABLE", "t.listed")
    flags.reset_cache()
    REGISTRY.activate()
    assert REGISTRY.patches["t.gated"].outcome.reason == "flag off (ASCEND_RL_TESTGATE=off)"
    assert "ASCEND_RL_DISABLE" in REGISTRY.patches["t.listed"].outcome.reason


def test_missing_target_warns_by_default_and_raises_under_strict(monkeypatch, caplog):
    f = _feature()
    f.after("textwrap:no_such_function", lambda r, i, a, k: r, dist=None, reason="t", remove_when="never", name="t.gone")
    with caplog.at_level(logging.WARNING, logger="ascend_rl_plugins"):
        REGISTRY.activate()
    p = REGISTRY.patches["t.gone"]
    assert p.outcome.state == "skipped" and "no_such_function" in p.outcome.reason
    assert "t.gone not applied" in caplog.text
    p.outcome.state = "inactive"
    monkeypatch.setenv("ASCEND_RL_STRICT", "1")
    flags.reset_cache()
    with pytest.raises(PatchError, match="ASCEND_RL_STRICT=1"):
        REGISTRY.activate()


def test_missing_module_is_reported_without_waiting_forever():
    f = _feature()
    f.after("json.no_such_module:thing", lambda r, i, a, k: r, dist=None, reason="t", remove_when="never", name="t.nomod")
    REGISTRY.activate()
    assert "does not exist" in REGISTRY.patches["t.nomod"].outcome.reason


def test_declared_parameters_are_checked_before_applying():
    f = _feature()
    f.wrap("textwrap:indent", lambda w, i, a, k: w(*a, **k), dist=None, reason="t", remove_when="never", name="t.sig",
           params=("text", "prefix", "no_such_param"))
    REGISTRY.activate()
    p = REGISTRY.patches["t.sig"]
    assert p.outcome.state == "skipped" and "no_such_param" in p.outcome.reason


def test_revert_refuses_when_someone_else_replaced_the_target():
    f = _feature()
    f.wrap("textwrap:shorten", lambda w, i, a, k: w(*a, **k), dist=None, reason="t", remove_when="never", name="t.w")
    REGISTRY.activate()
    textwrap.shorten = lambda *a, **k: "theirs"
    with pytest.raises(PatchError, match="someone else"):
        REGISTRY.revert(REGISTRY.patches["t.w"])


def test_a_failing_gate_is_recorded_not_raised():
    f = _feature()

    def broken_gate():
        raise RuntimeError("boom")

    f.after("textwrap:wrap", lambda r, i, a, k: r, dist=None, reason="t", remove_when="never", name="t.broken",
            enabled_by=broken_gate)
    REGISTRY.activate()
    p = REGISTRY.patches["t.broken"]
    assert p.outcome.state == "failed" and "boom" in p.outcome.reason


def test_set_attribute_creates_and_revert_removes():
    f = _feature()
    f.set("textwrap:ASCEND_RL_MARKER", 42, create=True, dist=None, reason="t", remove_when="never", name="t.set")
    REGISTRY.activate()
    assert textwrap.ASCEND_RL_MARKER == 42
    REGISTRY.revert_all()
    assert not hasattr(textwrap, "ASCEND_RL_MARKER")


def test_bad_target_and_kind_are_rejected_at_declaration():
    f = _feature()
    with pytest.raises(PatchError, match="module.path:Qualified.name"):
        f.wrap("textwrap.dedent", lambda *a: None, dist=None, reason="t", remove_when="never")
    with pytest.raises(PatchError, match="unknown patch kind"):
        f.patch("monkey", "textwrap:dedent", lambda *a: None, dist=None, reason="t", remove_when="never")
    with pytest.raises(PatchError, match="needs a reason"):
        f.wrap("textwrap:dedent", lambda *a: None, dist=None, reason="")


def test_lazy_application_on_a_real_vllm_module():
    pytest.importorskip("vllm")
    mod = "vllm.v1.core.sched.request_queue"
    if mod in sys.modules:
        pytest.skip("already imported")
    f = _feature()
    seen = []
    f.before(f"{mod}:FCFSRequestQueue.add_request", lambda i, a, k: seen.append(a) and None,
             dist="vllm", versions=">=0.13,<0.24", reason="t", remove_when="never", name="t.vllm", params=("request",))
    REGISTRY.activate()
    assert REGISTRY.patches["t.vllm"].outcome.state == "pending"
    q = importlib.import_module(mod).FCFSRequestQueue()
    q.add_request("r0")
    assert seen == [("r0",)] and REGISTRY.patches["t.vllm"].outcome.state == "applied"


def test_a_module_set_on_a_package_is_importable_as_its_submodule_until_reverted(tmp_path, monkeypatch):
    """A ``set`` patch whose value is a module, on a package, provides ``package.name`` to the
    import system too (``from package.name import x`` looks in ``sys.modules``, not at the
    package attribute); reverting removes the entry. Plain modules (no ``__path__``) and
    non-module values get no ``sys.modules`` entry."""
    import types

    pkg = tmp_path / "pkg_with_moved_module"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "new_home.py").write_text("class Moved:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    new_home = importlib.import_module("pkg_with_moved_module.new_home")
    alias = types.ModuleType("pkg_with_moved_module.old_home")
    alias.Moved = new_home.Moved
    f = _feature()
    f.set("pkg_with_moved_module:old_home", alias, create=True, rebind=False, dist=None, reason="t",
          remove_when="never", name="t.alias")
    f.set("textwrap:ASCEND_RL_MODULE_VALUE", alias, create=True, rebind=False, dist=None, reason="t",
          remove_when="never", name="t.not_a_package")
    REGISTRY.activate()
    from pkg_with_moved_module.old_home import Moved  # noqa: E402 - the import under test
    assert Moved is new_home.Moved
    assert importlib.import_module("pkg_with_moved_module.old_home") is alias
    assert "textwrap.ASCEND_RL_MODULE_VALUE" not in sys.modules
    REGISTRY.revert(REGISTRY.patches["t.alias"])
    assert "pkg_with_moved_module.old_home" not in sys.modules
    assert not hasattr(importlib.import_module("pkg_with_moved_module"), "old_home")
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("pkg_with_moved_module.old_home")


def test_a_submodule_entry_that_existed_before_is_put_back_on_revert(monkeypatch):
    import types

    pkg = types.ModuleType("pkg_double_for_submodule_revert")
    pkg.__path__ = []
    before = types.ModuleType("pkg_double_for_submodule_revert.thing")
    monkeypatch.setitem(sys.modules, pkg.__name__, pkg)
    monkeypatch.setitem(sys.modules, before.__name__, before)
    replacement = types.ModuleType("replacement")
    f = _feature()
    f.set(f"{pkg.__name__}:thing", replacement, create=True, rebind=False, dist=None, reason="t",
          remove_when="never", name="t.sub")
    REGISTRY.activate()
    assert sys.modules[before.__name__] is replacement and pkg.thing is replacement
    REGISTRY.revert_all()
    assert sys.modules[before.__name__] is before and not hasattr(pkg, "thing")


def test_undeclared_compositions_are_found_for_overlapping_ranges_only():
    """The framework check behind 'features compose': two wrappers of one target without
    distinct orders are reported when their version ranges may overlap (or belong to
    different distributions), never when the ranges are disjoint."""
    from ascend_rl_plugins.patching.core import undeclared_compositions
    a, b = _feature("ta"), _feature("tb")

    def hook(result, instance, args, kwargs):
        return result

    common = dict(reason="test", remove_when="never")
    p1 = a.after("textwrap:shorten", hook, name="ta.one", dist="pkg", versions=">=1,<3", **common)
    p2 = b.after("textwrap:shorten", hook, name="tb.one", dist="pkg", versions=">=2.5", **common)
    p3 = b.after("textwrap:shorten", hook, name="tb.two", dist="pkg", versions=">=3", **common)
    assert [len(undeclared_compositions(ps)) for ps in ([p1, p2], [p1, p3])] == [1, 0]
    p4 = b.after("textwrap:wrap", hook, name="tb.three", dist="other", versions=">=9", **common)
    p5 = a.after("textwrap:wrap", hook, name="ta.two", dist="pkg", versions="<1", **common)
    assert len(undeclared_compositions([p4, p5])) == 1
    p6 = a.after("textwrap:fill", hook, name="ta.three", dist="pkg", order=10, **common)
    p7 = b.after("textwrap:fill", hook, name="tb.four", dist="pkg", order=20, **common)
    assert undeclared_compositions([p6, p7]) == []


@pytest.mark.parametrize("a,b,overlap", [
    (">=0.12,<0.13", ">=0.16,<0.17", False),
    (">=0.12,<0.17", ">=0.16", True),
    (">0.13", "<=0.13", False),
    ("==0.13.*", ">=0.13.1,<0.14", True),
    ("<0.13", ">=0.13", False),
    (None, ">=9", True),
])
def test_version_ranges_overlap(a, b, overlap):
    from ascend_rl_plugins.patching.versions import may_overlap, parse_specifier
    assert may_overlap(parse_specifier(a), parse_specifier(b)) is overlap
