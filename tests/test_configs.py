"""Every config in configs/ loads, passes the checks, documents its command, and has the right size."""

import glob
import importlib.util
import os

import numpy as np
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


@pytest.mark.parametrize(
    "name, d_model, d_ff, heads, p_drop, steps",
    [("wmt14_ende_base", 512, 2048, 8, 0.1, 100_000), ("wmt14_ende_big", 1024, 4096, 16, 0.3, 300_000)],
)
def test_wmt14_configs_are_the_papers_table_3_recipe(name, d_model, d_ff, heads, p_drop, steps):
    """Table 3 and section 5 field by field (the parameter count above cannot see the number of
    heads, P_drop, the norm placement, the learning-rate scale, the vocabulary or the batch size):
    N=6 Post-LN blocks with sinusoidal positions, d_k = d_v = 64, one 37k BPE vocabulary shared by
    source, target and output, ~25k source + ~25k target token slots per step, 100k / 300k steps,
    and Eq. 3 with d_model^-0.5 * min(step^-0.5, step * 4000^-1.5) at scale 1."""
    from transformer_jax.training.schedules import create_schedule

    config = load(os.path.join(REPO, "configs", f"{name}.py")).get_config()
    cfg = ModelConfig.from_dict(config.model.to_dict())
    shape = (cfg.num_encoder_layers, cfg.num_decoder_layers, cfg.d_model, cfg.d_ff, cfg.num_heads, cfg.qk_dim)
    assert shape == (6, 6, d_model, d_ff, heads, 64)
    assert (cfg.dropout_rate, cfg.attention_dropout_rate, cfg.embedding_dropout_rate) == (p_drop, 0.0, None)
    assert (cfg.norm, cfg.position, cfg.activation) == ("post", "sinusoidal", "relu")
    assert cfg.share_embeddings and cfg.tie_output and cfg.scale_embeddings
    assert cfg.vocab_size == config.dataset.vocab_size == 37000
    ds = config.dataset
    for length in (ds.max_source_len, ds.max_target_len):
        assert 22_000 <= ds.batch_size * length <= 28_000  # "approximately 25000" tokens per side
    assert ds.pack and config.num_train_steps == steps
    opt = config.optimizer
    assert (opt.name, opt.schedule, opt.learning_rate, opt.weight_decay, opt.grad_clip_norm) == (
        "adam", "rsqrt_paper", 1.0, 0.0, 0.0)
    lr = create_schedule(opt, cfg.d_model, config.num_train_steps)
    # the optimizer's count c is step c + 1: steps 1, 4000 (the peak) and 16000, by hand
    want = {512: (1.7469281e-07, 6.9877124e-04, 3.4938562e-04),
            1024: (1.2352647e-07, 4.9410588e-04, 2.4705294e-04)}[d_model]
    np.testing.assert_allclose([float(lr(c)) for c in (0, 3999, 15999)], want, rtol=1e-6)
    assert (config.beam_size, config.beam_alpha, config.test_split) == (4, 0.6, "test")
    assert config.decode_extra_len == 50  # section 6.1: outputs of at most input length + 50


def test_gpt2_small_config_has_gpt2_smalls_shape():
    """12 layers, d_model 768, 12 heads, d_ff 3072, 1024 learned positions filled by rows of 1024
    tokens, Pre-LN with eps 1e-5 and a final norm, tanh-GELU, tied head, dropout 0.1 (also on
    attention): GPT-2's 124M (124,439,808 parameters) less (50257 - 32000) * 768 embedding rows
    for our 32k vocabulary.
    Trained as its docstring says: AdamW (0.9, 0.95), weight decay 0.1, clipping 1.0, no label
    smoothing."""
    config = load(os.path.join(REPO, "configs", "gpt2_small.py")).get_config()
    cfg = ModelConfig.from_dict(config.model.to_dict())
    shape = (cfg.num_encoder_layers, cfg.num_decoder_layers, cfg.d_model, cfg.num_heads, cfg.d_ff)
    assert shape == (0, 12, 768, 12, 3072) and cfg.max_len == 1024
    assert config.dataset.max_len == 1024 and config.dataset.vocab_size == cfg.vocab_size == 32000
    assert (cfg.norm, cfg.norm_eps, cfg.activation, cfg.position, cfg.dropout_rate) == (
        "pre", 1e-5, "gelu_tanh", "learned", 0.1)
    # GPT-2's resid_pdrop, embd_pdrop and attn_pdrop are all 0.1
    assert (cfg.attention_dropout_rate, cfg.embedding_dropout_rate) in [(0.1, None), (0.1, 0.1)]
    assert cfg.tie_output and not cfg.scale_embeddings
    assert count_params(cfg) == 124_439_808 - (50257 - 32000) * 768 == 110_418_432
    opt = config.optimizer
    assert (opt.name, opt.b1, opt.b2, opt.eps, opt.weight_decay, opt.grad_clip_norm, opt.label_smoothing) == (
        "adamw", 0.9, 0.95, 1e-8, 0.1, 1.0, 0.0)
    assert (opt.schedule, opt.learning_rate, opt.warmup_steps) == ("cosine", 6e-4, 2000)


# (config, its docstring's shape: (encoder layers, decoder layers, d_model, heads, d_ff, norm, position),
#  parameters counted by hand, dataset row length or (source, target) lengths, rows per batch)
DOCUMENTED = [
    # 2 encoder layers of 4(128^2 + 128) + 2(128 * 512) + 512 + 128 + 4 * 128 = 198,272, 2 decoder
    # layers of 264,576 (a second attention, a third norm), 2000 * 128 shared embeddings: 1,181,696
    ("default", (2, 2, 128, 4, 512, "post", "sinusoidal"), 1_181_696, (32, 32), 64),
    # 4 layers of 4(256^2 + 256) + 2(256 * 1024) + 1024 + 256 + 4 * 256 = 789,760, 4000 * 256
    # embeddings, 256 * 256 learned positions, a final norm of 512: 4,249,088 (~4.2M)
    ("lm_stdlib", (0, 4, 256, 4, 1024, "pre", "learned"), 4_249_088, 256, 32),
    # 6 layers of 4(512^2 + 512) + 2(512 * 2048) + 2048 + 512 + 4 * 512 = 3,152,384, 32000 * 512
    # embeddings, a final norm of 1024: 35,299,328
    ("lm1b", (0, 6, 512, 8, 2048, "pre", "sinusoidal"), 35_299_328, 128, 256),
]


@pytest.mark.parametrize("name, shape, params, lengths, rows", DOCUMENTED, ids=[d[0] for d in DOCUMENTED])
def test_configs_have_the_shape_their_docstrings_state(name, shape, params, lengths, rows):
    config = load(os.path.join(REPO, "configs", f"{name}.py")).get_config()
    cfg = ModelConfig.from_dict(config.model.to_dict())
    assert (cfg.num_encoder_layers, cfg.num_decoder_layers, cfg.d_model, cfg.num_heads, cfg.d_ff,
            cfg.norm, cfg.position) == shape
    assert count_params(cfg) == params
    ds = config.dataset
    got = (ds.max_source_len, ds.max_target_len) if cfg.num_encoder_layers else ds.max_len
    assert (got, ds.batch_size) == (lengths, rows)
