"""Every config field transformers' qwen4_exp reads: honoured (our logits equal transformers' for an edited
config.json text_config, prompt and decode steps), or refused in one sentence naming the field, at setup
and at engine load (docs/model.md "Config fields")."""

import json
import shutil

import pytest
import torch

from expertstream.experts.cpu_bank import DenseExperts
from expertstream.formats.text_config import ConfigError, check_config
from expertstream.models.base import ModelArgs
from expertstream.models.qwen4_exp import Qwen4ExpModel
from expertstream.models.state import State
from expertstream.store.ple import DenseTable

qwen4 = pytest.importorskip("transformers.models.qwen4_exp.modeling_qwen4_exp")
from test_model import randomise  # noqa: E402
from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig  # noqa: E402

EOS, VOCAB, PROMPT, STEPS = 7, 96, 24, 6

# a config.json text_config as a checkpoint writes it: four layers, PLE on the second, QSA on the last
BASE = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 24,
    "num_experts": 8,
    "num_experts_per_tok": 3,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "hc_count": 4,
    "hc_lowrank": 8,
    "ple_layer_ids": [2],
    "ngram_vocab_size_base": 50,
    "make_ngram_vocab_size_divisible_by": 8,
    "eos_token_id": EOS,
    "indexer_n_heads": 2,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 16,
    "indexer_budget": 8,
    "indexer_compress_ratio": 2,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    "output_gate_type": "sigmoid",
    "max_position_embeddings": 64,
}


def edit(**changes):
    """BASE with `changes` applied; a value of `...` deletes the key."""
    d = json.loads(json.dumps(BASE))
    for k, v in changes.items():
        if v is ...:
            d.pop(k, None)
        else:
            d[k] = v
    return d


ROPE_NO_THETA = {"rope_type": "default", "partial_rotary_factor": 0.5}
# (id, text_config): each differs from BASE in fields transformers reads
HONOURED = [
    ("shipped-like", edit()),
    ("hidden_act-swish", edit(hidden_act="swish")),
    ("output_gate_type-silu", edit(output_gate_type="silu")),
    ("output_gate_type-from-hidden_act", edit(output_gate_type=...)),
    ("attention_bias", edit(attention_bias=True)),
    ("top-level-rope_theta-merged", edit(rope_parameters=ROPE_NO_THETA, rope_theta=500.0)),
    (
        "top-level-partial_rotary_factor-merged",
        edit(rope_parameters={"rope_type": "default", "rope_theta": 1e4}, partial_rotary_factor=0.25),
    ),
    ("legacy-rope-keys-only", edit(rope_parameters=..., rope_theta=300.0, partial_rotary_factor=1.0)),
    ("no-rope-keys", edit(rope_parameters=...)),
    ("rope_scaling-wins", edit(rope_scaling={"type": "default", "rope_theta": 77.0})),
    ("mrope_section", edit(rope_parameters={**BASE["rope_parameters"], "mrope_section": [2, 1, 1]})),
    ("full_attention_interval", edit(layer_types=..., full_attention_interval=3, num_hidden_layers=6)),
    ("layer_types-default-pattern", edit(layer_types=...)),
    ("norm_topk_prob-false", edit(norm_topk_prob=False)),
    ("num_experts_per_tok-1", edit(num_experts_per_tok=1)),
    ("rms_norm_eps", edit(rms_norm_eps=0.05)),
    ("hc_count-3-hc_lowrank-5", edit(hc_count=3, hc_lowrank=5)),
    ("linear_conv_kernel_dim-2", edit(linear_conv_kernel_dim=2)),
    (
        "ple-shape-fields",
        edit(ple_conv_kernel_size=2, ngram_size=2, heads_per_ngram=4, ple_embed_dim=16, seed=99),
    ),
    (
        "indexer-fields",
        edit(indexer_n_heads=3, indexer_head_dim=8, indexer_budget=4, indexer_compress_ratio=4),
    ),
    ("eos_token_id-list", edit(eos_token_id=[5, EOS])),
    (
        "attention-shape-fields",
        edit(num_attention_heads=2, num_key_value_heads=1, head_dim=24, indexer_head_dim=24),
    ),
    ("linear-shape-fields", edit(linear_num_key_heads=4, linear_key_head_dim=4, linear_value_head_dim=6)),
    ("expert-shape-fields", edit(moe_intermediate_size=8, shared_expert_intermediate_size=4, num_experts=5)),
    ("no-ple", edit(ple_layer_ids=[])),
    (
        "inference-inert-fields",
        edit(
            initializer_range=0.5,
            attention_dropout=0.3,
            use_cache=False,
            output_router_logits=True,
            router_aux_loss_coef=0.5,
            pad_token_id=3,
            bos_token_id=4,
            split_ngram_parts=3,
            tie_word_embeddings=False,
            max_position_embeddings=48,
        ),
    ),
]


def pair(tc: dict):
    """transformers' model built from the text_config dict as config.json holds it, and ours from the same
    dict and weights."""
    cfg = Qwen4ExpTextConfig(**json.loads(json.dumps(tc)))
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    tf_model = qwen4.Qwen4ExpForCausalLM(cfg).eval()
    randomise(tf_model)
    sd = {k.removeprefix("model."): v.detach().clone() for k, v in tf_model.state_dict().items()}
    args = ModelArgs.from_dict(tc)
    n = args.num_hidden_layers
    bank = DenseExperts(
        [sd.pop(f"layers.{i}.mlp.experts.gate_up_proj") for i in range(n)],
        [sd.pop(f"layers.{i}.mlp.experts.down_proj") for i in range(n)],
    )
    tables = [sd.pop(f"layers.{i}.ple.ple_embedding.ngram_embedding.weight") for i in args.ple_layers]
    table = DenseTable(tables[0]) if tables else None
    return tf_model, Qwen4ExpModel(args, sd, bank, table), args


@pytest.mark.parametrize("tc", [tc for _, tc in HONOURED], ids=[i for i, _ in HONOURED])
def test_config_variant_matches_transformers(tc):
    check_config({"model_type": "qwen4_exp", "text_config": tc})  # not refused
    tf_model, ours, args = pair(tc)
    ids = torch.randint(0, VOCAB, (PROMPT,), generator=torch.Generator().manual_seed(2))
    ids[[9, 10, 17]] = EOS  # documents end inside the prompt
    with torch.no_grad():
        ref = tf_model(ids[None], use_cache=False).logits[0].float()
    st = State(args, 64, torch.float32, "cpu")
    got = ours.logits(ours(ids[: PROMPT - STEPS], st))
    got = torch.cat([got, *(ours.logits(ours(ids[i : i + 1], st)) for i in range(PROMPT - STEPS, PROMPT))])
    assert (got - ref).abs().max() <= 1e-4 * ref.abs().max()
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_the_sweep_is_sensitive_to_the_fields():
    # a field the engine dropped would leave our logits at BASE's: every variant must move transformers'
    ids = torch.arange(PROMPT) % VOCAB
    with torch.no_grad():
        base = pair(BASE)[0](ids[None], use_cache=False).logits[0]
        for name in (
            "attention_bias",
            "top-level-rope_theta-merged",
            "rope_scaling-wins",
            "norm_topk_prob-false",
        ):
            tc = dict(HONOURED)[name]
            assert not torch.allclose(pair(tc)[0](ids[None], use_cache=False).logits[0], base, atol=1e-4), (
                name
            )


# (field named in the refusal, text_config edit, top-level edit)
REFUSED = [
    ("hidden_act", {"hidden_act": "gelu", "output_gate_type": "silu"}, {}),
    ("hidden_act", {"hidden_act": "relu", "output_gate_type": "sigmoid"}, {}),
    ("hidden_act", {"hidden_act": "sigmoid"}, {}),
    ("output_gate_type", {"output_gate_type": "tanh"}, {}),
    ("output_gate_type", {"hidden_act": "swish", "output_gate_type": None}, {}),
    ("tie_word_embeddings", {"tie_word_embeddings": True}, {}),
    ("tie_word_embeddings", {}, {"tie_word_embeddings": True}),
    ("rope_type", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, {}),
    ("rope_type", {"rope_scaling": {"type": "yarn", "factor": 4.0}}, {}),
    ("rope_parameters", {"rope_parameters": {"linear_attention": {"rope_theta": 1.0}}}, {}),
    ("indexer_kv_heads", {"indexer_kv_heads": 2}, {}),
    ("ple_layer_ids", {"ple_layer_ids": [1, 2]}, {}),
    ("layer_types", {"layer_types": ["linear_attention"] * 3 + ["mamba"]}, {}),
    ("layer_types", {"layer_types": ["linear_attention"] * 3}, {}),
    ("indexer_budget", {"indexer_budget": None}, {}),
]


@pytest.mark.parametrize(
    "field,text_edit,top_edit", REFUSED, ids=[f"{r[0]}-{i}" for i, r in enumerate(REFUSED)]
)
def test_refused_field_is_named_in_one_sentence(field, text_edit, top_edit):
    config = {"model_type": "qwen4_exp", **top_edit, "text_config": {**BASE, **text_edit}}
    with pytest.raises(ConfigError) as e:
        check_config(config, "snap/config.json")
    msg = str(e.value)
    assert msg.startswith("snap/config.json: ") and field in msg
    assert "\n" not in msg and msg.count(". ") == 0
    if not top_edit:  # the model's own parse refuses it too
        with pytest.raises(ValueError, match=field):
            ModelArgs.from_dict(config["text_config"])


def _edit_config(path, **text_edit):
    cfg = json.loads(path.read_text())
    cfg["text_config"].update(text_edit)
    path.write_text(json.dumps(cfg))


def test_setup_refuses_an_unsupported_field(tiny_snapshot, tmp_path, capsys):
    from expertstream.cli import main as cli

    snap = tmp_path / "snap"
    shutil.copytree(tiny_snapshot, snap)
    _edit_config(snap / "config.json", hidden_act="gelu", output_gate_type="silu")
    assert cli(["setup", str(snap), str(tmp_path / "wd"), "--no-progress"]) == 1
    out = capsys.readouterr().out.strip()
    assert out.startswith("expertstream setup: error: ") and "hidden_act 'gelu'" in out
    assert len(out.splitlines()) == 1 and not (tmp_path / "wd").exists()


def test_engine_refuses_an_existing_workdir_with_an_unsupported_field(tiny_workdir, tmp_path):
    from expertstream.config import EngineConfig
    from expertstream.runtime.engine import Engine
    from expertstream.workdir.checksum import ALGORITHM, file_checksum
    from expertstream.workdir.workdir import WorkdirError, read_manifest, write_manifest

    wd = tmp_path / "wd"
    shutil.copytree(tiny_workdir, wd)
    _edit_config(wd / "config.json", rope_parameters={"rope_type": "dynamic", "factor": 2.0})
    # record the edited file's checksum, so the config rule refuses it and not the changed-file check
    manifest = read_manifest(wd)
    size, crc = file_checksum(wd / "config.json")
    manifest["files"]["config.json"] = {"bytes": size, ALGORITHM: crc}
    write_manifest(wd, manifest)
    with pytest.raises(WorkdirError, match=r"config\.json: rope_type 'dynamic' is not supported"):
        Engine(EngineConfig(model=str(wd), device="cpu"))


def test_memory_plan_derives_layer_types_as_transformers():
    from test_memory_plan import BLOCK, real_resident, real_text_config

    from expertstream.formats.text_config import layer_types
    from expertstream.memory_plan import GiB, plan_memory

    tc = real_text_config()
    implicit = {k: v for k, v in tc.items() if k != "layer_types"}
    implicit["full_attention_interval"] = 3
    explicit = {**implicit, "layer_types": layer_types(implicit)}
    assert explicit["layer_types"] != tc["layer_types"]
    plans = [plan_memory(c, real_resident(), BLOCK, 8 * GiB, 32768) for c in (implicit, explicit)]
    assert plans[0] == plans[1] != plan_memory(tc, real_resident(), BLOCK, 8 * GiB, 32768)
