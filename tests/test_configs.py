"""Every config in configs/ loads, passes the checks, documents its command, and has the right size."""

import glob
import importlib.util
import os

import pytest

from transformer_jax.config import ModelConfig
from transformer_jax.params import count_params
from transformer_jax.training import check_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(REPO, "configs", "*.py")))


def load(path):
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_all_configs_are_there():
    names = {os.path.basename(p)[:-3] for p in CONFIGS}
    assert {
        "default",
        "tiny",
        "lm_stdlib",
        "wmt14_ende_base",
        "wmt14_ende_big",
        "lm1b",
        "gpt2_small",
    } <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: os.path.basename(p))
def test_config_is_valid_and_documented(path):
    module = load(path)
    config = module.get_config()
    check_config(config)
    model = ModelConfig.from_dict(config.model.to_dict())
    assert model.vocab_size >= config.dataset.vocab_size
    assert "python train.py" in module.__doc__ or "pytest" in module.__doc__
    for key in ("data", "fsdp", "tensor"):
        assert key in config.mesh


@pytest.mark.parametrize("name, millions", [("wmt14_ende_base", 63.08), ("wmt14_ende_big", 214.25)])
def test_paper_sizes(name, millions):
    config = load(os.path.join(REPO, "configs", f"{name}.py")).get_config()
    cfg = ModelConfig.from_dict(config.model.to_dict())
    assert count_params(cfg) / 1e6 == pytest.approx(millions, abs=0.2)
    opt = config.optimizer
    assert (opt.b1, opt.b2, opt.eps, opt.warmup_steps, opt.label_smoothing) == (0.9, 0.98, 1e-9, 4000, 0.1)
    assert opt.schedule == "rsqrt_paper"


def _parse(argv):
    from absl import flags
    from ml_collections import config_flags

    values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", flag_values=values, sys_argv=argv)
    values(argv)
    return values.config


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: os.path.basename(p))
def test_every_model_field_can_be_set_from_the_command_line(path):
    # kernel_layout, pad_vocab_multiple, scan_layers: fields most configs leave out; head_dim,
    # num_kv_heads, final_norm: fields whose default is None, which ml_collections can override only
    # through a typed placeholder.
    argv = ["train.py", f"--config={path}", "--config.model.kernel_layout=out_in",
            "--config.model.pad_vocab_multiple=64", "--config.model.scan_layers=True",
            "--config.model.head_dim=16", "--config.model.num_kv_heads=1", "--config.model.final_norm=False"]
    config = _parse(argv)
    check_config(config)
    model = ModelConfig.from_dict(config.model.to_dict())
    changed = dict(kernel_layout="out_in", pad_vocab_multiple=64, scan_layers=True, head_dim=16,
                   num_kv_heads=1, final_norm=False)
    assert {k: getattr(model, k) for k in changed} == changed
    # The fields the config leaves out get ModelConfig's defaults, as before.
    unset = ModelConfig.from_dict(load(path).get_config().model.to_dict())
    assert unset.head_dim is None and unset.num_kv_heads is None
    assert model == unset.replace(**changed)


def test_a_field_a_config_sets_to_none_can_be_set_from_the_command_line(tmp_path):
    path = tmp_path / "no_pad.py"
    path.write_text(
        "from configs.tiny import get_config as tiny\n"
        "from transformer_jax.training import with_defaults\n"
        "def get_config():\n"
        "    c = tiny()\n"
        "    c.model.pad_id = None\n"
        "    return with_defaults(c)\n"
    )
    import sys
    sys.path.insert(0, REPO)
    try:
        assert ModelConfig.from_dict(_parse(["train.py", f"--config={path}"]).model.to_dict()).pad_id is None
        config = _parse(["train.py", f"--config={path}", "--config.model.pad_id=0"])
    finally:
        sys.path.remove(REPO)
    assert ModelConfig.from_dict(config.model.to_dict()).pad_id == 0
    with pytest.raises(Exception, match="pad_id"):
        _parse(["train.py", f"--config={path}", "--config.model.pad_id=zero"])
