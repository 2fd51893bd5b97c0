"""Config loading: defaults < file < overrides, and loud refusals of what is wrong."""

import pytest
from conftest import REPO, TINY, run_cli

from pipeline.config import Config, ConfigError, check_runtime, describe, flatten, load_config


def test_defaults_file_and_overrides_in_that_order():
    cfg = load_config(TINY, ["optim.lr=0.5", "train.max_steps=3", "model.args.hidden=[8, 4]"])
    # override beats the file's 0.05
    assert cfg.optim.lr == 0.5
    assert cfg.train.max_steps == 3
    assert cfg.model.args["hidden"] == [8, 4]
    # from the file
    assert cfg.model.args["width"] == 0.125
    # default
    assert cfg.optim.momentum == Config().optim.momentum


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
    with pytest.raises(
        ConfigError, match="unknown config key 'trian' at the top level.*Did you mean 'train'"
    ):
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
    check_runtime(
        load_config(TINY, ["train.global_batch_size=32"]), world_size=4, cuda_available=False
    )


def test_flatten_and_describe_cover_every_field():
    flat = flatten(Config())
    assert flat["optim.lr"] == 0.1 and "serve.port" in flat
    text = describe()
    for key in flat:
        assert key in text, key
    # every field has a comment
    assert "#  " not in text


def test_docs_config_md_is_what_pipeline_config_describe_markdown_prints():
    from pipeline.config_cli import MARKDOWN_COMMAND, markdown

    page = markdown()
    for key in flatten(Config()):
        assert f"| `{key}` |" in page, key
    assert (REPO / "docs" / "config.md").read_text() == page, (
        f"docs/config.md is not current with the config's fields; regenerate it: {MARKDOWN_COMMAND}"
    )


def test_the_regenerate_command_prints_the_page_and_markdown_needs_describe(tmp_path):
    printed = run_cli(["config", "--describe", "--markdown"], cwd=tmp_path).stdout
    assert printed == (REPO / "docs" / "config.md").read_text()
    alone = run_cli(["config", "--markdown"], cwd=tmp_path, check=False)
    assert alone.returncode == 2 and "--markdown goes with --describe" in alone.stderr


def test_built_in_names_are_shorthands_for_their_components(tmp_path):
    cfg = load_config(TINY, ["model.name=mlp", "data.name=synthetic"])
    assert (
        cfg.model.component == "pipeline.models:mlp"
        and cfg.data.component == "pipeline.datasets:synthetic"
    )
    # the defaults
    assert load_config(None).model.component == "pipeline.models:resnet18"
    # In one file both is a contradiction; on the command line the later setting wins over the
    # file's.
    (tmp_path / "both.yaml").write_text("model: {name: mlp, component: 'my.models:Net'}\n")
    with pytest.raises(
        ConfigError,
        match="model.name=mlp means model.component=pipeline.models:mlp, but "
        "model.component=my.models:Net is set too",
    ):
        load_config(tmp_path / "both.yaml")
    assert load_config(TINY, ["model.component=my.models:Net"]).model.component == "my.models:Net"
    assert (
        load_config(REPO / "configs/digits_resnet18.yaml", ["model.name=mlp"]).model.component
        == "pipeline.models:mlp"
    )


def test_a_component_reference_must_be_module_colon_attribute():
    with pytest.raises(
        ConfigError,
        match="model.component 'my_project.models.Net' is not a reference of the form "
        "'module.path:attribute'.*did you mean 'my_project.models:Net'",
    ):
        load_config(None, ["model.component=my_project.models.Net"])
    with pytest.raises(ConfigError, match="task.loss.component 'x y:z' is not a reference"):
        load_config(
            None,
            [
                "task.name=custom",
                "task.loss.component=x y:z",
                "task.metric.component=m:f",
                "task.metric_mode=min",
            ],
        )


def test_a_components_own_arguments_are_pointed_to_args():
    with pytest.raises(
        ConfigError, match="unknown config key 'model.width'.*Did you mean 'model.args.width'"
    ):
        load_config(TINY, ["model.width=0.5"])


def test_custom_tasks_need_their_parts_and_others_refuse_them():
    with pytest.raises(
        ConfigError, match="task.name=custom needs task.loss, task.metric, task.metric_mode"
    ):
        load_config(None, ["task.name=custom"])
    with pytest.raises(ConfigError, match="task.metric_mode only apply to task.name=custom"):
        load_config(None, ["task.metric_mode=max"])
    cfg = load_config(
        None,
        [
            "task.name=custom",
            "task.loss.component=torch.nn:L1Loss",
            "task.metric.component=m:f",
            "task.metric_mode=min",
        ],
    )
    assert cfg.task.loss.args == {} and cfg.task.metric.component == "m:f"


def test_dynamic_axes_never_name_the_batch_axis():
    with pytest.raises(ConfigError, match="export.dynamic_axes: axes must be >= 1"):
        load_config(None, ["export.dynamic_axes={tokens: [0]}"])
    assert load_config(None, ["export.dynamic_axes.tokens=[1]"]).export.dynamic_axes == {
        "tokens": [1]
    }
