"""A user's reward module that cannot be imported, or a reward that exits: named errors, not a dead rank.

Issue 26, defect 9: only ImportError/AttributeError were caught at import, so a syntax error or an
exception in the module's own code gave a bare traceback (exit 1, the dry run included), and a
reward calling ``sys.exit`` ended its rank with that code and no message.
"""

from __future__ import annotations

import pytest

from ds_tree.rollout.rewards import RewardRequest, score
from tests.helpers.configs import online_config
from tests.helpers.runs import dry_run

MODULES = {
    "syntax_error": ("def reward(request):\n    return (1.0\n", "SyntaxError: '(' was never closed"),
    "raises": ("raise RuntimeError('no checker database here')\n", "RuntimeError: no checker database here"),
    "exits": ("import sys\nsys.exit(3)\n", "SystemExit: the module called sys.exit(3)"),
}


@pytest.mark.parametrize("kind", sorted(MODULES))
def test_reward_module_import_failure_is_a_config_error(kind, tmp_path, monkeypatch, capsys, tokenizer_dir) -> None:
    source, what = MODULES[kind]
    module = f"ds_tree_test_reward_{kind}"
    (tmp_path / f"{module}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = online_config(tmp_path, tokenizer_dir)
    code, err = dry_run(monkeypatch, capsys, config, f"rollout.reward={module}:reward")
    assert code == 2, err
    assert f"config error: {config}: rollout.reward '{module}:reward' cannot be imported: module '{module}': " in err
    assert what in err, err
    if kind == "syntax_error":
        assert f"({tmp_path / module}.py, line 2)" in err, err
    assert "Traceback" not in err


def test_reward_that_exits_is_a_reward_failure() -> None:
    def exits(request: RewardRequest) -> float:
        if request.completion == "bye":
            raise SystemExit(3)
        if request.completion == "quit":
            import sys

            sys.exit()
        return 1.0

    requests = [RewardRequest("p", c, {}) for c in ("ok", "bye", "quit")]
    rewards, failures = score(exits, requests)
    assert rewards == [1.0, None, None]
    assert "request 1" in failures[0] and "SystemExit: the reward code called sys.exit(3)" in failures[0]
    assert "request 2" in failures[1] and "sys.exit(None)" in failures[1]
