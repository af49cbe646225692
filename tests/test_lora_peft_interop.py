"""Our LoRA adapters and the real ``peft`` package agree (fp32, one rank,
tests/helpers/lora_worker.py):

* adapters we export load with ``PeftModel.from_pretrained`` and give our logprobs;
* an adapter ``peft`` made (q/v/down only) loads into our engine and gives PEFT's logprobs;
* with the adapters off, the engine is the HF base model (the LoRA reference model);
* merged full weights (``lora.sync: merged``) equal the adapter model;
* an adapter-only checkpoint holds no base weight, and a step after resuming from it equals
  the step the original run takes.
"""

import pytest

from tests.helpers.lora_layouts import launch

TOL = 1e-5


@pytest.fixture(scope="module")
def interop(tmp_path_factory):
    return launch("prepared_interop", tmp_path_factory.mktemp("lora_interop"), world=1)[0]


def test_our_adapter_in_peft_gives_our_logprobs(interop):
    assert interop["ours_in_peft"] < TOL, interop
    assert interop["adapters_change_output"] > 0.1, interop  # the adapters do something


def test_peft_made_adapter_loads_into_our_engine(interop):
    assert interop["peft_tensors_loaded"] == 12.0  # 2 layers x 3 modules x (A, B)
    assert interop["theirs_in_ours"] < TOL, interop
    # an engine without adapters on down_proj refuses the file, naming its 4 tensors
    assert interop["extra_tensors_refused"] == 1.0, interop


def test_adapters_off_is_the_base_model(interop):
    assert interop["adapters_off_is_base"] < TOL, interop


def test_merged_export_equals_the_adapter_model(interop):
    assert interop["merged_export"] < TOL, interop


def test_adapter_checkpoint_resumes_exactly(interop):
    assert interop["ckpt_model_keys"] > 0 and interop["ckpt_base_keys"] == 0, interop
    assert interop["resumed_step"] == 0.0 and interop["resumed_step_count"] == 1.0, interop
