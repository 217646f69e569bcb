import pytest

from trainwarden.agent.common.preflight import preflight

pytestmark = pytest.mark.timeout(10)


def test_a_missing_script_a_missing_module_and_a_bad_fault_spec_are_found_before_launch(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    assert preflight([str(script), "--lr", "0.1"], {}) == []
    assert preflight(["-m", "trainwarden.runtime.examples.gpt"], {}) == []
    assert preflight(["-m", "json.tool"], {"TRAINWARDEN_FAULTS": "crash:rank=1,step=3"}) == []
    [missing] = preflight([str(tmp_path / "trian.py")], {})
    assert "does not exist" in missing and "trian.py" in missing
    [module] = preflight(["-m", "trainwardne.runtime.examples.gpt"], {})
    assert "no package 'trainwardne'" in module
    [faults] = preflight([str(script)], {"TRAINWARDEN_FAULTS": "crash:rank=x,step=3"})
    assert faults.startswith("TRAINWARDEN_FAULTS: fault 'crash:rank=x,step=3': rank='x' is not an integer")
