"""A tiny random Mixtral from transformers, run with its own eager experts and with
experts_implementation="comet" (comet.moe_layer0 -> SwiGLU -> comet.moe_layer1, world of one),
printing the largest logits difference. CPU, fp32, no download:

    .venv/bin/python examples/hf_moe.py
"""
import os
import sys

import torch

try:
    import transformers
except ImportError:  # an optional dependency: say which extra brings it, no traceback
    print("examples/hf_moe.py needs transformers (the 'hf' extra): pip install "
          "--no-build-isolation -e '.[hf]' in this checkout, or pip install 'comet-moe[hf]' "
          "(make setup installs it too)",
          file=sys.stderr)
    sys.exit(2)

# Run from a checkout: this repository's comet before any installed one.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import comet.hf  # noqa: E402


def main():
    comet.hf.register()  # makes experts_implementation="comet" a valid choice
    transformers.logging.set_verbosity_error()
    config = transformers.MixtralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=64, initializer_range=0.1, experts_implementation="eager")
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config).eval()
    tokens = torch.randint(0, config.vocab_size, (2, 16))

    with torch.no_grad():
        eager = model(tokens).logits
        model.set_experts_implementation("comet")
        fused = model(tokens).logits
    print(f"Mixtral (tiny, random): {sum(p.numel() for p in model.parameters())} parameters, "
          f"{config.num_local_experts} experts, top-{config.num_experts_per_tok}, "
          f"logits {tuple(fused.shape)}")
    print(f"max |logits| {eager.abs().max():.4f}")
    print(f"max |logits difference| eager vs comet: {(fused - eager).abs().max():.3e}")


if __name__ == "__main__":
    main()
