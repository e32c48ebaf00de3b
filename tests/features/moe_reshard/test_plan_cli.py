"""``ascend-rl moe-reshard plan``'s argument errors: a zero or negative size is refused instead
of planning nothing, and a layout the planner cannot serve is explained in the options the user
typed (``--rollout-tp`` x ``--rollout-dp``, ``--pp-layers``), not the planner's field names."""

import pytest

from ascend_rl_plugins import cli

SHAPE = ["--layers", "4", "--experts", "8", "--hidden", "16", "--ffn", "32"]


def _plan(capsys, *argv: str) -> tuple[int, str]:
    code = cli.main(["moe-reshard", "plan", *argv])
    return code, capsys.readouterr().err.strip()


@pytest.mark.parametrize("option,value", [("--layers", "-1"), ("--experts", "0"), ("--rollout-dp", "0"),
                                          ("--bucket-mb", "0")])
def test_a_size_below_one_is_refused_naming_the_option(capsys, option, value):
    argv = list(SHAPE)
    if option in argv:
        argv[argv.index(option) + 1] = value
    else:
        argv += [option, value]
    code, err = _plan(capsys, *argv)
    assert code == 2 and err.startswith(f"ascend-rl moe-reshard: error: cannot plan: {option} {value} must be >"), err


@pytest.mark.parametrize("extra,says", [
    (["--ep", "2"], "--rollout-tp 1 x --rollout-dp 1 = 1"),
    (["--pp", "2", "--rollout-dp", "2", "--pp-layers", "1,2"], "--pp-layers 1,2 must give --pp 2 layer counts"),
    (["--pp", "3", "--rollout-dp", "3"], "give --pp-layers"),
])
def test_a_layout_error_is_said_in_the_options_typed(capsys, extra, says):
    code, err = _plan(capsys, *SHAPE, *extra)
    assert code == 2 and says in err, err
    assert "etp*ep*pp" not in err and "layer_stages" not in err and "world 1 " not in err, err
