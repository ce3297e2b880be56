"""Checkpoints whose tokenizer or model is their own Python code (``auto_map``, as Kimi K2's tokenization_kimi.py):
refused in one line unless trusted, loaded as the checkpoint's class when trusted, and the servers' command lines
carry --trust-remote-code exactly when trusted. Offline: the checkpoint is ``remote_tokenizer_dir`` (conftest)."""

import json
import shutil

import pytest
from miles.rollout.config import SGLangEngineConfig, VLLMEngineConfig
from miles.rollout.engines.launch import planned_servers
from miles.rollout.engines.sglang import launch_command
from miles.rollout.engines.vllm import vllm_command
from miles.rollout.multimodal import load_tokenizer
from miles.rollout.remote_code import check_remote_code, remote_code_files
from miles.rollout.serve import main as serve_main
from miles.rollout.serve import parse_args as serve_args


def test_a_tokenizer_of_the_checkpoints_own_class_is_found_from_its_json_alone(remote_tokenizer_dir, tiny_smollm2_dir):
    assert remote_code_files(remote_tokenizer_dir) == ["tokenizer_config.json"]
    assert remote_code_files(tiny_smollm2_dir) == []
    assert remote_code_files(remote_tokenizer_dir / "no_such_dir") == []


def test_an_untrusted_checkpoint_with_its_own_code_is_one_line_naming_the_setting(remote_tokenizer_dir):
    with pytest.raises(ValueError) as err:
        check_remote_code(
            remote_tokenizer_dir,
            trusted=False,
            where="models.policy.path",
            fix="set models.policy.trust_remote_code: true",
        )
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"models.policy.path {remote_tokenizer_dir} ships its own code (auto_map in ")
    assert "tokenizer_config.json" in message and "set models.policy.trust_remote_code: true" in message
    check_remote_code(remote_tokenizer_dir, trusted=True, where="models.policy.path", fix="")  # trusted: passes


def test_a_trusted_tokenizer_is_the_checkpoints_own_class_with_the_same_ids(remote_tokenizer_dir, tiny_smollm2_dir):
    tokenizer = load_tokenizer(remote_tokenizer_dir, trust_remote_code=True)
    assert type(tokenizer).__name__ == "ShoutTokenizer"
    assert tokenizer.checkpoint_code == "tokenization_custom.py"  # only the checkpoint's class has it
    text = "What is 1 + 1?"
    assert tokenizer(text)["input_ids"] == load_tokenizer(tiny_smollm2_dir)(text)["input_ids"]


def _with_config(src, dst, **fields):
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, **fields}))
    return dst


def test_auto_map_beside_a_class_transformers_holds_needs_no_trust(tiny_smollm2_dir, tmp_path):
    # As DeepSeek-V3's config.json: its own classes named, but transformers loads its own deepseek_v3 without trust.
    auto_map = {"AutoConfig": "configuration_custom.CustomConfig", "AutoModelForCausalLM": "modeling_custom.Custom"}
    known = _with_config(tiny_smollm2_dir, tmp_path / "known", auto_map=auto_map)
    assert remote_code_files(known) == []
    unknown = _with_config(tiny_smollm2_dir, tmp_path / "unknown", auto_map=auto_map, model_type="shout_llama")
    assert remote_code_files(unknown) == ["config.json"]


def test_the_vllm_command_has_trust_remote_code_exactly_when_trusted():
    assert "--trust-remote-code" not in vllm_command("/m", port=1)
    assert vllm_command("/m", port=1, trust_remote_code=True).count("--trust-remote-code") == 1
    with pytest.raises(ValueError, match="set --models.policy.trust-remote-code true instead"):
        vllm_command("/m", port=1, extra_args=["--trust-remote-code"])


def test_the_sglang_command_has_trust_remote_code_exactly_when_trusted():
    assert "--trust-remote-code" not in launch_command("/m")
    assert launch_command("/m", trust_remote_code=True).count("--trust-remote-code") == 1
    with pytest.raises(ValueError, match="set --models.policy.trust-remote-code true instead"):
        launch_command("/m", extra_args=["--trust-remote-code"])


@pytest.mark.parametrize(
    "cfg",
    [
        pytest.param(SGLangEngineConfig(server="sglang"), id="sglang"),
        pytest.param(SGLangEngineConfig(server="miles"), id="miles_serve"),
        pytest.param(VLLMEngineConfig(), id="vllm"),
    ],
)
def test_every_planned_server_gets_trust_remote_code_exactly_when_trusted(cfg, tiny_smollm2_dir):
    def argv(trusted):
        return planned_servers(cfg, tiny_smollm2_dir, 0, ports=[30000], trust_remote_code=trusted)[0].argv

    assert "--trust-remote-code" not in argv(False)
    assert argv(True).count("--trust-remote-code") == 1


def test_miles_serve_takes_trust_remote_code_and_refuses_its_checkpoint_without_it(remote_tokenizer_dir, capsys):
    assert serve_args(["--model", "/m", "--trust-remote-code"]).trust_remote_code
    assert not serve_args(["--model", "/m"]).trust_remote_code
    assert serve_main(["--model", str(remote_tokenizer_dir)]) == 2  # before any model loads
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"miles serve: --model {remote_tokenizer_dir} ships its own code")
    assert "pass --trust-remote-code if you trust" in err
