"""Writes the files in this folder with hkt 0.2.0 (commit 49c1afb): a
MultiheadHKT state_dict with windows, one without, and a converted tiny
Llama-style Hugging Face model saved with save_pretrained, each with the
outputs that version computes from it (tests/nn/test_compat_v0_2_0.py loads them
with the code of the day and compares).  Run from the repository root with
that version installed: python tests/data/v0_2_0/make_files.py
"""
import json
import os

import torch
from safetensors.torch import save_file

import hkt

HERE = os.path.dirname(os.path.abspath(__file__))
F64 = torch.float64

# constructor arguments of the two modules (plain values, kept in the files)
MODULES = {
    "mha_windows": dict(embed_dim=16, num_heads=4, num_kv_heads=2, levels=3, batch_first=True,
                        windows=[4, 8, None], dtype=F64),
    "mha_plain": dict(embed_dim=16, num_heads=2, levels=3, downsample_kernel=3, dtype=F64),
}


def _module_file(name: str, kwargs: dict) -> None:
    torch.manual_seed(0)
    m = hkt.MultiheadHKT(**kwargs)
    with torch.no_grad():  # coarse levels that matter (level_logits start at zero)
        m.level_logits.normal_()
        m.q_downsample.add_(0.3 * torch.randn_like(m.q_downsample))
        m.k_downsample.add_(0.3 * torch.randn_like(m.k_downsample))
        m.coarse_q_proj_bias.normal_()
    B, T, E = 2, 13, kwargs["embed_dim"]
    x = torch.randn((B, T, E) if kwargs.get("batch_first") else (T, B, E), dtype=F64, requires_grad=True)
    out, weights = m(x, x, x, is_causal=True, need_weights=True, average_attn_weights=False)
    out.pow(2).sum().backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.eval()
    with torch.no_grad():
        cache = m.init_cache(B, 32)
        steps = [m.decode(x[:, :5] if m.batch_first else x[:5], cache)]
        for t in range(5, T):
            steps.append(m.decode(x[:, t:t + 1] if m.batch_first else x[t:t + 1], cache))
        decoded = torch.cat(steps, dim=1 if m.batch_first else 0)
    kwargs = {k: v for k, v in kwargs.items() if k != "dtype"}
    # one flat safetensors file (the repository keeps no pickled checkpoints):
    # state.<name> the state_dict, grad.<name> the parameters' gradients
    tensors = {"state." + n: t for n, t in m.state_dict().items()}
    tensors.update({"grad." + n: g for n, g in grads.items()})
    tensors.update({"x": x.detach(), "out": out.detach(), "weights": weights.detach(), "x_grad": x.grad,
                    "decoded": decoded})
    save_file({n: t.contiguous() for n, t in tensors.items()}, os.path.join(HERE, name + ".safetensors"),
              metadata={"kwargs": json.dumps(kwargs), "hkt": hkt.__version__})


def _hf_files() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    import hkt.integrations.transformers as ht
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = ht.convert(LlamaForCausalLM(config).eval(), levels=3)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # trained-looking HKT parameters: the coarse levels change the output
        for m in model.modules():
            if isinstance(m, ht.HKTLevels):
                for p in (m.q_downsample, m.k_downsample):
                    p.copy_(0.5 + 0.3 * torch.randn(p.shape, generator=g))
                m.coarse_q_proj.copy_(0.4 * torch.randn(m.coarse_q_proj.shape, generator=g))
                m.coarse_k_proj.add_(0.2 * torch.randn(m.coarse_k_proj.shape, generator=g))
                m.level_logits.copy_(0.5 * torch.randn(m.level_logits.shape, generator=g))
    model.save_pretrained(os.path.join(HERE, "llama_levels3"))
    ids = torch.randint(3, 64, (2, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
        gen = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    save_file({"ids": ids, "mask": mask, "logits": logits, "sequences": gen.sequences,
               "gen_logits": torch.stack(gen.logits, dim=1).contiguous()},
              os.path.join(HERE, "llama_levels3_outputs.safetensors"), metadata={"hkt": hkt.__version__})


if __name__ == "__main__":
    assert hkt.__version__ == "0.2.0", hkt.__version__
    for name, kwargs in MODULES.items():
        _module_file(name, kwargs)
    _hf_files()
