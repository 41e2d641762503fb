"""The weights bench's command line: bad modes and sizes exit 2 naming them, before any load."""

from __future__ import annotations

import pytest

from agentspec.bench import weights


@pytest.mark.parametrize("argv, named", [(["--modes", "int3"], "int3"),
                                         (["--modes", ""], "--modes"),
                                         (["--context", "8"], "--context")])
def test_a_bad_option_exits_2_naming_it(argv, named, capsys, monkeypatch):
    monkeypatch.setattr(weights, "measure", lambda *a, **k: pytest.fail("measured"))
    with pytest.raises(SystemExit) as exc:
        weights.main(argv)
    assert exc.value.code == 2
    assert named in capsys.readouterr().err
