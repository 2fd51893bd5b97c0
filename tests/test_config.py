"""Config loading: defaults < file < overrides, and loud refusals of what is wrong."""

import pytest

from pipeline.config import Config, ConfigError, check_runtime, describe, flatten, load_config

from conftest import REPO, TINY


def test_defaults_file_and_overrides_in_that_order():
    cfg = load_config(TINY, ["optim.lr=0.5", "train.max_steps=3", "model.hidden=[8, 4]"])
    assert cfg.optim.lr == 0.5  # override beats the file's 0.05
    assert cfg.train.max_steps == 3
    assert cfg.model.hidden == [8, 4]
    assert cfg.model.width == 0.125  # from the file
    assert cfg.optim.momentum == Config().optim.momentum  # default


def test_every_shipped_config_loads():
    for path in sorted((REPO / "configs").glob("*.yaml")):
        load_config(path)


def test_unknown_key_is_refused_with_suggestion_and_allowed_keys():
    with pytest.raises(ConfigError) as err:
        load_config(TINY, ["optim.lrr=0.1"])
    msg = str(err.value)
    assert "unknown config key 'optim.lrr'" in msg
    assert "Did you mean 'optim.lr'" in msg
    assert "Allowed:" in msg and "weight_decay" in msg


def test_unknown_section_is_refused():
    with pytest.raises(ConfigError, match="unknown config key 'trian' at the top level.*Did you mean 'train'"):
        load_config(None, ["trian.max_steps=3"])


def test_wrong_type_names_key_and_value():
    with pytest.raises(ConfigError) as err:
        load_config(TINY, ["train.global_batch_size=lots"])
    assert "train.global_batch_size" in str(err.value) and "'lots'" in str(err.value)


def test_wrong_choice_lists_the_allowed_ones():
    with pytest.raises(ConfigError) as err:
        load_config(TINY, ["train.precision=fp8"])
    assert "train.precision" in str(err.value) and "'bf16'" in str(err.value)


def test_malformed_override_and_missing_file():
    with pytest.raises(ConfigError, match="not of the form section.key=value"):
        load_config(TINY, ["optim.lr"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("configs/nope.yaml")


def test_fp16_on_cpu_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match="fp16 needs CUDA.*bf16"):
        load_config(TINY, ["train.precision=fp16", "train.device=cpu"])
    cfg = load_config(TINY, ["train.precision=fp16"])
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        check_runtime(cfg, world_size=1, cuda_available=False)


def test_batch_must_divide_by_world_size_times_accumulation():
    cfg = load_config(TINY, ["train.global_batch_size=30", "train.grad_accum_steps=2"])
    with pytest.raises(ConfigError) as err:
        check_runtime(cfg, world_size=4, cuda_available=False)
    assert "must divide by world size (4) x train.grad_accum_steps (2) = 8" in str(err.value)
    assert "train.global_batch_size=24 or 32" in str(err.value)
    check_runtime(load_config(TINY, ["train.global_batch_size=32"]), world_size=4, cuda_available=False)


def test_flatten_and_describe_cover_every_field():
    flat = flatten(Config())
    assert flat["optim.lr"] == 0.1 and "serve.port" in flat
    text = describe()
    for key in flat:
        assert key in text, key
    assert "#  " not in text  # every field has a comment


def test_readme_lists_every_field_exactly_as_describe_prints_it():
    assert describe().strip() in (REPO / "README.md").read_text()
