"""Tiny random-weight models built from transformers config classes and saved with save_pretrained,
plus a tokenizer, so every test runs with no hub access."""
from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 384


def _tokenizer_files(path: Path) -> None:
    """A byte-level BPE tokenizer trained on a few sentences (vocab 384), saved as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of France.",
              "Hello world! Héllo wörld, ünïcode ✓ 東京", "def f(x): return x * 2"] * 50
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                          "{% if add_generation_prompt %}<s>assistant:{% endif %}")
    fast.save_pretrained(str(path))


def make_tiny_model(path: Path, arch: str = "llama", tie: bool = False, num_kv_heads: int = 2,
                    seed: int = 0, **overrides) -> Path:
    """Write a tiny random model of the given family to ``path``. Returns ``path``."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=num_kv_heads, max_position_embeddings=512,
                  tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    # mixture of experts: 8 experts, top-2, tiny expert widths (Qwen2-MoE: a shared expert too;
    # Qwen3-MoE: norm_topk_prob on, Qwen2-MoE: off, as their defaults)
    common.update({
        "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=48, sliding_window=None),
        "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                          shared_expert_intermediate_size=48),
        "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16,
                          norm_topk_prob=True),
    }.get(arch, {}))
    common.update(overrides)
    cls = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM),
        "qwen2_moe": (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM),
        "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM),
        "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM),  # checkpoint holds qkv_proj and gate_up_proj fused
        "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM),
        "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM),
        # Gemma 3 with its (tiny SigLIP) vision tower: the engine serves the text model
        "gemma3_mm": (lambda **kw: tf.Gemma3Config(
            text_config=kw, tie_word_embeddings=kw["tie_word_embeddings"], mm_tokens_per_image=4,
            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                               image_size=28, patch_size=14)), tf.Gemma3ForConditionalGeneration),
    }[arch]
    if arch == "qwen3":
        common.setdefault("head_dim", 16)
    if arch.startswith("gemma"):
        # head_dim != hidden / heads, a softmax scale that is not head_dim's, one local and one global layer
        common.setdefault("head_dim", 16)
        common.setdefault("query_pre_attn_scalar", 24)
        common.setdefault("layer_types", ["sliding_attention", "full_attention"])
    if arch in ("mistral", "phi3"):
        common.setdefault("sliding_window", None)
    torch.manual_seed(seed)
    cfg = cls[0](**common)
    model = cls[1](cfg).to(torch.float32)
    with torch.no_grad():  # larger-than-default weights so logits are far from uniform
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
            else:  # norm weights and biases: perturb so they are not all ones / zeros
                p.add_(torch.randn_like(p) * 0.05)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True)
    _tokenizer_files(path)
    return path


def make_tiny_base_model(path: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """A tiny random bare ``*Model`` (LlamaModel, Qwen3Model, ...: no lm_head, tensor names without
    the ``model.`` prefix), saved as embedding checkpoints are, with the same tokenizer. Returns ``path``."""
    import shutil

    import transformers as tf

    causal = make_tiny_model(path.with_name(path.name + "-causal"), arch, seed=seed, **overrides)
    base = tf.AutoModelForCausalLM.from_pretrained(str(causal), dtype=torch.float32).model
    path.mkdir(parents=True, exist_ok=True)
    base.save_pretrained(str(path), safe_serialization=True)
    for f in causal.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")) or f.name == "chat_template.jinja":
            shutil.copy(f, path / f.name)
    return path
