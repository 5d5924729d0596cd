"""comet.hf: transformers models with experts_implementation="comet" against the same models with
their own eager experts (Mixtral, Qwen2-MoE, OLMoE, GPT-OSS; tiny random configs built here, no
downloads): logits, input gradients and every parameter gradient, fp32 within 1e-5 and bf16 within
2e-2; the experts really run through comet's ops; expert parallelism over 2 gloo processes with
shard_experts against the unsharded eager model; clear errors. Skipped without transformers."""
import os
import runpy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import comet  # noqa: E402
import comet.hf  # noqa: E402
from tests.dist_utils import run_ranks  # noqa: E402
from tests.layer0_spy import spy_layer0  # noqa: E402

H, F, E, K = 16, 12, 4, 2
FAMILIES = ["mixtral", "qwen2_moe", "olmoe", "gpt_oss"]


def build(family, layers=2, dtype=torch.float32, seed=0):
    """A tiny random model of `family` with eager experts, weights ~N(0, 0.3) (the default 0.02
    init would make every expert output vanish next to the residual stream)."""
    transformers.logging.set_verbosity_error()
    common = dict(vocab_size=64, hidden_size=H, num_hidden_layers=layers, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=32, num_experts_per_tok=K,
                  experts_implementation="eager")
    if family == "mixtral":
        cfg = transformers.MixtralConfig(intermediate_size=F, num_local_experts=E, **common)
        cls = transformers.MixtralForCausalLM
    elif family == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(moe_intermediate_size=F, num_experts=E,
                                          shared_expert_intermediate_size=20,
                                          intermediate_size=24, norm_topk_prob=False, **common)
        cls = transformers.Qwen2MoeForCausalLM
    elif family == "olmoe":
        cfg = transformers.OlmoeConfig(intermediate_size=F, num_experts=E, **common)
        cls = transformers.OlmoeForCausalLM
    elif family == "gpt_oss":
        # a small swiglu_limit, so that the clamps of GPT-OSS's activation really cut
        cfg = transformers.GptOssConfig(intermediate_size=F, num_local_experts=E, head_dim=8,
                                        swiglu_limit=0.6, **common)
        cls = transformers.GptOssForCausalLM
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    model = cls(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.3)
    return model.to(dtype)


def experts_modules(model):
    return [m for m in model.modules() if comet.hf.is_experts_module(m)]


def run(model, impl, embeds):
    """(logits, d embeds, {name: grad}) of the model with experts implementation `impl`."""
    model.set_experts_implementation(impl)
    model.zero_grad(set_to_none=True)
    x = embeds.clone().requires_grad_()
    logits = model(inputs_embeds=x).logits
    logits.float().square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), x.grad, grads


@pytest.fixture(autouse=True, scope="module")
def _registered():
    comet.hf.register()


def count_calls(monkeypatch):
    calls = {"layer0": 0, "layer1": 0}
    real0, real1 = comet.moe_layer0, comet.moe_layer1

    def layer0(*a, **kw):
        calls["layer0"] += 1
        return real0(*a, **kw)

    def layer1(*a, **kw):
        calls["layer1"] += 1
        return real1(*a, **kw)

    monkeypatch.setattr(comet, "moe_layer0", layer0)
    monkeypatch.setattr(comet, "moe_layer1", layer1)
    return calls


def compare(family, ref, got, atol, rtol):
    (l_ref, dx_ref, g_ref), (l_got, dx_got, g_got) = ref, got
    torch.testing.assert_close(l_got, l_ref, atol=atol, rtol=rtol,
                               msg=lambda m: f"{family} logits: {m}")
    torch.testing.assert_close(dx_got, dx_ref, atol=atol, rtol=rtol,
                               msg=lambda m: f"{family} d inputs: {m}")
    assert g_got.keys() == g_ref.keys()
    assert any("experts" in n for n in g_ref), "no expert weight got a gradient"
    for name, g in g_ref.items():
        torch.testing.assert_close(g_got[name], g, atol=atol, rtol=rtol,
                                   msg=lambda m, name=name: f"{family} d{name}: {m}")


@pytest.mark.parametrize("family", FAMILIES)
def test_comet_experts_match_eager_fp32(family, monkeypatch):
    model = build(family)
    embeds = torch.randn(2, 7, H, generator=torch.Generator().manual_seed(1))
    ref = run(model, "eager", embeds)
    calls = count_calls(monkeypatch)
    got = run(model, "comet", embeds)
    assert calls == {"layer0": 2, "layer1": 2}, calls  # one pair per MoE layer
    assert ref[0].abs().max() > 0.5, "logits too small for a meaningful comparison"
    compare(family, ref, got, atol=1e-5, rtol=1e-5)


def record_activations(monkeypatch):
    """The activation= each comet.moe_layer0 call passes (None: the module's own runs after)."""
    seen = []
    real0 = comet.moe_layer0

    def layer0(*a, **kw):
        seen.append(kw.get("activation"))
        return real0(*a, **kw)

    monkeypatch.setattr(comet, "moe_layer0", layer0)
    return seen


@pytest.mark.parametrize("family,fused", [("mixtral", "swiglu"), ("qwen2_moe", "swiglu"),
                                          ("olmoe", "swiglu"), ("gpt_oss", None)])
def test_fused_activation_where_the_model_has_one(family, fused, monkeypatch):
    """SwiGLU through transformers' default gate is fused into layer0 (and still matches eager:
    test_comet_experts_match_eager_*); GPT-OSS's own clamped, interleaved gate is not."""
    model = build(family, layers=1)
    assert comet.hf.fused_activation(experts_modules(model)[0]) == fused
    embeds = torch.randn(2, 7, H, generator=torch.Generator().manual_seed(1))
    ref = run(model, "eager", embeds)
    seen = record_activations(monkeypatch)
    got = run(model, "comet", embeds)
    assert seen == [fused], seen
    compare(family, ref, got, atol=1e-5, rtol=1e-5)


def test_gpt_oss_clamps_and_biases_are_exercised():
    """The GPT-OSS case above means something: its clamps cut and its biases matter."""
    model = build("gpt_oss", layers=1)
    exp = experts_modules(model)[0]
    x = torch.randn(14, H, generator=torch.Generator().manual_seed(1))
    gate_up = torch.einsum("th,ehn->etn", x, exp.gate_up_proj) + exp.gate_up_proj_bias[:, None]
    assert (gate_up[..., ::2] > exp.limit).any() and (gate_up[..., 1::2].abs() > exp.limit).any()
    model.set_experts_implementation("comet")
    ids = torch.tensor([[0, 1], [2, 3]]).repeat(7, 1)
    w = torch.full((14, 2), 0.5)
    with torch.no_grad():
        out = exp(x, ids, w)
        exp.down_proj_bias.add_(1.0)
        shifted = exp(x, ids, w)
    torch.testing.assert_close(shifted - out, torch.ones_like(out), atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_comet_experts_match_eager_bf16(family, monkeypatch):
    # One layer: with two, bf16 rounding differences before the second router could flip a
    # near-tie in its top-k and send a token to another expert (a different function).
    model = build(family, layers=1, dtype=torch.bfloat16)
    embeds = torch.randn(2, 7, H, generator=torch.Generator().manual_seed(1)).bfloat16()
    ref = run(model, "eager", embeds)
    calls = count_calls(monkeypatch)
    got = run(model, "comet", embeds)
    assert calls == {"layer0": 1, "layer1": 1}, calls  # comet ran (one pair for the one layer)
    assert got[0].dtype == torch.bfloat16
    compare(family, ref, got, atol=2e-2, rtol=2e-2)


def test_errors_name_the_problem():
    model = build("mixtral", layers=1)
    exp = experts_modules(model)[0]
    model.set_experts_implementation("comet")
    x = torch.randn(3, H)
    ids, w = torch.tensor([[0, 1], [1, 2], [3, 0]]), torch.full((3, 2), 0.5)
    exp.has_post_expert_norm = True
    with pytest.raises(NotImplementedError, match="MixtralExperts applies a norm"):
        exp(x, ids, w)
    exp.has_post_expert_norm = False
    with pytest.raises(ValueError, match=r"\[T, k\], got \(3, 16\), \(3, 2\), \(2, 2\)"):
        exp(x, ids, w[:2])
    with pytest.raises(ValueError, match="expert id"):  # comet's own check of the routing
        exp(x, torch.tensor([[0, 1], [1, 7], [3, 0]]), w)
    with pytest.raises(ValueError, match="not initialised"):
        comet.hf.shard_experts(model)
    buffers = comet.Buffer.simulated_world(3)
    with pytest.raises(ValueError, match="num_experts=4, not divisible by the group size 3"):
        comet.hf.shard_experts(model, buffer=buffers[0])
    with pytest.raises(ValueError, match="no transformers experts module"):
        comet.hf.shard_experts(torch.nn.Linear(2, 2), buffer=buffers[0])


# -- expert parallelism over 2 processes ----------------------------------------------------------

def _ep_body(rank, world, family):
    import torch.distributed as dist

    comet.hf.register()
    g = torch.Generator().manual_seed(20 + rank)  # each rank its own tokens
    embeds = torch.randn(1 + rank, 5 + 2 * rank, H, generator=g)
    eager = build(family)
    ref = run(eager, "eager", embeds)
    # Unsharded comet experts while torch.distributed is up: a private world of one.
    compare(f"{family} unsharded rank {rank}", ref, run(build(family), "comet", embeds),
            atol=1e-5, rtol=1e-5)

    sharded = comet.hf.shard_experts(build(family))
    mods = experts_modules(sharded)
    assert all(m.gate_up_proj.shape[0] == E // world for m in mods)
    assert sharded.config._experts_implementation == "comet"
    logits, dx, grads = run(sharded, "comet", embeds)
    torch.testing.assert_close(logits, ref[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dx, ref[1], atol=1e-5, rtol=1e-5)
    per = E // world
    for name, g_ref in ref[2].items():
        if name.split(".")[-1] in comet.hf._EXPERT_PARAMS:
            # the owner's gradient sums every rank's tokens: compare with the summed eager ones
            total = g_ref.clone()
            dist.all_reduce(total)
            g_ref = total[rank * per:(rank + 1) * per]
            assert getattr(dict(sharded.named_parameters())[name], "comet_expert_parallel")
        torch.testing.assert_close(grads[name], g_ref, atol=1e-5, rtol=1e-5,
                                   msg=lambda m, name=name: f"rank {rank} d{name}: {m}")
    return float((logits - ref[0]).abs().max())


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_shard_experts_two_processes_match_unsharded_eager(family):
    diffs = run_ranks(_ep_body, 2, family, timeout=120)
    assert len(diffs) == 2


def test_example_prints_small_difference(capsys):
    path = os.path.join(os.path.dirname(__file__), "..", "examples", "hf_moe.py")
    runpy.run_path(path, run_name="__main__")
    out = capsys.readouterr().out
    assert "max |logits difference|" in out
    line = next(x for x in out.splitlines() if "max |logits difference|" in x)
    diff = float(line.rsplit(":", 1)[1])
    assert diff < 1e-5, out


def test_ungated_biased_experts_module(monkeypatch):
    """The other layout flags of @use_experts_implementation: no gate (up_proj + act_fn), biases
    on untransposed weights, on a standalone experts module with its own eager forward."""
    from transformers import PretrainedConfig
    from transformers.integrations.moe import use_experts_implementation

    @use_experts_implementation(has_gate=False, has_bias=True)
    class UngatedExperts(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            self.num_experts = E
            self.up_proj = torch.nn.Parameter(torch.randn(E, F, H) * 0.3)
            self.up_proj_bias = torch.nn.Parameter(torch.randn(E, F))
            self.down_proj = torch.nn.Parameter(torch.randn(E, H, F) * 0.3)
            self.down_proj_bias = torch.nn.Parameter(torch.randn(E, H))
            self.act_fn = torch.nn.GELU()

        def forward(self, x, ids, weights):
            up = torch.einsum("th,tkfh->tkf", x, self.up_proj[ids]) + self.up_proj_bias[ids]
            down = torch.einsum("tkf,tkhf->tkh", self.act_fn(up), self.down_proj[ids])
            return ((down + self.down_proj_bias[ids]) * weights[..., None]).sum(1)

    torch.manual_seed(3)
    config = PretrainedConfig(experts_implementation="eager")
    module = UngatedExperts(config)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(9, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(9)])
    w = torch.rand(9, K, generator=g)
    results, calls = [], count_calls(monkeypatch)
    assert comet.hf.fused_activation(module) == "gelu"  # exact GELU, no gate: fused
    module.act_fn = torch.nn.GELU(approximate="tanh")
    assert comet.hf.fused_activation(module) is None  # the tanh form is not comet's: unfused
    module.act_fn = torch.nn.GELU()
    for impl in ("eager", "comet"):
        config._experts_implementation = impl
        module.zero_grad(set_to_none=True)
        xr = x.clone().requires_grad_()
        out = module(xr, ids, w)
        out.square().sum().backward()
        results.append((out.detach(), xr.grad, [p.grad for p in module.parameters()]))
    assert calls == {"layer0": 1, "layer1": 1}  # the comet pass, and only it
    (o_e, dx_e, g_e), (o_c, dx_c, g_c) = results
    torch.testing.assert_close(o_c, o_e, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dx_c, dx_e, atol=1e-5, rtol=1e-5)
    for a, b in zip(g_c, g_e):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_max_rows_takes_the_sync_free_path(family):
    """set_max_rows: layer0 gets the bound (WORST_CASE: W * T * min(k, E/W) for the call's T,
    or a user's int) and returns that many rows; logits and every gradient equal the eager
    experts' and the dynamic comet path's."""
    model = build(family)
    embeds = torch.randn(2, 7, H, generator=torch.Generator().manual_seed(3))
    ref = run(model, "eager", embeds)
    dynamic = run(model, "comet", embeds)
    T = embeds.shape[0] * embeds.shape[1]
    for bound, rows in ((comet.nn.WORST_CASE, T * K), (T * K + 3, T * K + 3), (-1, None)):
        comet.hf.set_max_rows(model, bound)  # -1: back to the dynamic path
        with spy_layer0() as seen:
            got = run(model, "comet", embeds)
        assert [b for b, _ in seen] == [rows] * 2, seen  # both MoE layers
        if rows is not None:
            assert [m for _, m in seen] == [rows] * 2, seen
        compare(family, ref, got, atol=1e-5, rtol=1e-5)
        # the model's activation runs on the padded rows too: torch's vectorised and scalar
        # sigmoid differ by an ulp, so a different row count may move a value by one
        compare(family, dynamic, got, atol=1e-6, rtol=1e-6)
    comet.hf.set_max_rows(model, 5)  # a user's bound that is too small
    with pytest.raises(ValueError, match="max_rows is 5"):
        run(model, "comet", embeds)
    with pytest.raises(ValueError, match="max_rows=2.5 must be"):
        comet.hf.set_max_rows(model, 2.5)
