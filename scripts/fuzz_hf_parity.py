"""Parity fuzzer: random tiny HF models of every family against meshlm, in shapes and
settings the tests do not pin (head counts, head_dim, windows, layer_types, RoPE scaling
types and factors, biases, tied embeddings, tokenizers): import logits, export logits,
the bitwise round trip, and greedy generation token for token. Needs the test extra.

    python scripts/fuzz_hf_parity.py [N_CASES] [SEED] [only case indices...]

One line per case; "FAIL" marks a case over 1e-5, a changed tensor, or other tokens.
"""
import os
import random
import shutil
import sys
import tempfile
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(REPO, "tests"), REPO]
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from test_families import NEW_TOKENS, hf_greedy  # noqa: E402
from tiny_hf import hf_tensors, make_tokenizer, randomize, torch_logits  # noqa: E402
from trainer import hf, loading  # noqa: E402
from trainer.generate import generate  # noqa: E402

transformers.logging.set_verbosity_error()
ROOT = tempfile.mkdtemp(prefix="meshlm-fuzz-")
PROMPTS = ["The with statement", "Hi",
           "A longer prompt about the Python data model and its special methods, "
           "with enough words to span many tokens."]
VOCAB = 300
_TOKS = {}


def tokenizer(kind):
    if kind not in _TOKS:
        _TOKS[kind] = make_tokenizer(kind)
    return _TOKS[kind]


# ------------------------------------------------------------------ random configs
def heads(r, need_hidden_multiple):
    H = r.choice([1, 2, 3, 4, 6, 8])
    divs = [d for d in range(1, H + 1) if H % d == 0]
    mode = r.choice(["mha", "mqa", "gqa"])
    K = H if mode == "mha" else 1 if mode == "mqa" else r.choice(divs)
    explicit = r.random() < 0.4
    if explicit:
        head_dim = r.choice(range(8, 34, 2))
        hidden = r.choice([h for h in range(32, 97, 8) if (h % H == 0 or not need_hidden_multiple)]
                          or [H * 8])
        if hidden // H == head_dim:
            head_dim += 2
    else:
        hd = r.choice([d for d in range(4, 34, 2) if 32 <= H * d <= 96])
        hidden, head_dim = H * hd, None
    return dict(num_attention_heads=H, num_key_value_heads=K, hidden_size=hidden), head_dim


def layer_types(r, layers):
    return [r.choice(["sliding_attention", "full_attention"]) for _ in range(layers)]


def theta(r):
    return float(r.choice([100.0, 1000.0, 10000.0, 500000.0, 1e6, round(10 ** r.uniform(2, 6), 1)]))


def rope(r, kinds=("default", "linear", "llama3", "yarn")):
    kind = r.choice(kinds)
    p = {"rope_type": kind, "rope_theta": theta(r)}
    if kind == "linear":
        p["factor"] = round(r.uniform(1.5, 8), 3)
    elif kind == "llama3":
        low = round(r.uniform(0.5, 2), 3)
        p.update(factor=round(r.uniform(2, 32), 3), low_freq_factor=low,
                 high_freq_factor=round(low + r.uniform(0.5, 6), 3),
                 original_max_position_embeddings=r.choice([16, 24, 32, 64, 128]))
    elif kind == "yarn":
        p.update(factor=round(r.uniform(1.5, 16), 3), beta_fast=round(r.uniform(4, 64), 3),
                 beta_slow=round(r.uniform(0.25, 3), 3),
                 original_max_position_embeddings=r.choice([16, 32, 48, 64, 128, 256]))
        if r.random() < 0.4:
            p["attention_factor"] = round(r.uniform(0.5, 2.0), 3)
        elif r.random() < 0.3:
            p["mscale"], p["mscale_all_dim"] = round(r.uniform(0.5, 1.5), 3), round(r.uniform(0.5, 1.5), 3)
        if r.random() < 0.3:
            p["truncate"] = False
    return p


def random_case(r, family):
    common = dict(vocab_size=VOCAB, intermediate_size=r.choice(range(32, 129, 8)),
                  num_hidden_layers=r.randint(1, 4),
                  max_position_embeddings=r.choice([256, 512, 1024, 4096]),
                  rms_norm_eps=r.choice([1e-6, 1e-5, 1e-3]))
    kw = dict(common)
    if family == "llama":
        h, hd = heads(r, False)
        kw.update(h, tie_word_embeddings=r.random() < 0.5, attention_bias=r.random() < 0.4,
                  mlp_bias=r.random() < 0.3, rope_parameters=rope(r),
                  hidden_act=r.choice(["silu", "silu", "gelu", "gelu_pytorch_tanh"]))
        if hd:
            kw["head_dim"] = hd
        cls = transformers.LlamaConfig
    elif family == "mistral":
        h, hd = heads(r, False)
        kw.update(h, tie_word_embeddings=r.random() < 0.3,
                  sliding_window=r.choice([None, r.randint(3, 20), r.randint(3, 20)]),
                  rope_parameters=rope(r, ("default", "default", "linear", "yarn")))
        if hd:
            kw["head_dim"] = hd
        cls = transformers.MistralConfig
    elif family == "qwen2":
        h, hd = heads(r, True)
        sw = r.random() < 0.6
        kw.update(h, tie_word_embeddings=r.random() < 0.5, use_sliding_window=sw,
                  sliding_window=r.randint(3, 20), rope_parameters=rope(r, ("default", "default", "yarn", "llama3")),
                  max_window_layers=r.randint(0, kw["num_hidden_layers"]),
                  hidden_act=r.choice(["silu", "silu", "gelu"]))
        if hd and r.random() < 0.5:
            kw["head_dim"] = hd
        if sw and r.random() < 0.4:
            kw["layer_types"] = layer_types(r, kw["num_hidden_layers"])
        cls = transformers.Qwen2Config
    elif family == "qwen3":
        h, hd = heads(r, False)
        sw = r.random() < 0.5
        kw.update(h, tie_word_embeddings=r.random() < 0.5, use_sliding_window=sw,
                  attention_bias=r.random() < 0.5, sliding_window=r.randint(3, 20),
                  max_window_layers=r.randint(0, kw["num_hidden_layers"]),
                  rope_parameters=rope(r, ("default", "default", "linear", "yarn")))
        kw["head_dim"] = hd or h["hidden_size"] // h["num_attention_heads"]
        if sw and r.random() < 0.4:
            kw["layer_types"] = layer_types(r, kw["num_hidden_layers"])
        cls = transformers.Qwen3Config
    elif family == "gemma3":
        h, hd = heads(r, True)
        L = kw["num_hidden_layers"]
        types = layer_types(r, L)
        full = rope(r, ("default", "linear", "yarn"))
        slide = rope(r, ("default", "default", "linear", "yarn"))
        kw.update(h, head_dim=hd or h["hidden_size"] // h["num_attention_heads"],
                  layer_types=types, sliding_window=r.randint(3, 20),
                  query_pre_attn_scalar=r.choice([8, 16, 24, 64, 100, 256]),
                  final_logit_softcapping=r.choice([None, round(r.uniform(2, 50), 2)]),
                  attention_bias=r.random() < 0.3, tie_word_embeddings=r.random() < 0.7,
                  hidden_activation=r.choice(["gelu_pytorch_tanh", "gelu_pytorch_tanh", "gelu"]),
                  rope_parameters={"full_attention": full, "sliding_attention": slide})
        cls = transformers.Gemma3TextConfig
    elif family == "phi3":
        h, hd = heads(r, False)
        kw.update(h, tie_word_embeddings=r.random() < 0.3,
                  sliding_window=r.choice([None, r.randint(3, 20)]),
                  rope_parameters={"rope_type": "default", "rope_theta": theta(r)})
        if hd:
            kw["head_dim"] = hd
        cls = transformers.Phi3Config
    return cls, kw


def describe(family, kw):
    s = [f"H{kw['num_attention_heads']}/K{kw['num_key_value_heads']}", f"D{kw['hidden_size']}",
         f"L{kw['num_hidden_layers']}"]
    if kw.get("head_dim"):
        s.append(f"hd{kw['head_dim']}")
    rp = kw.get("rope_parameters", {})
    if "full_attention" in rp:
        s.append("rope[full=" + ",".join(f"{k}={v}" for k, v in rp["full_attention"].items())
                 + "; slide=" + ",".join(f"{k}={v}" for k, v in rp["sliding_attention"].items()) + "]")
    else:
        s.append("rope[" + ",".join(f"{k}={v}" for k, v in rp.items()) + "]")
    for k in ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window"):
        if kw.get(k):
            s.append(k.replace("_word_embeddings", "").replace("attention_", "a").replace("use_", ""))
    if kw.get("sliding_window") is not None and (family in ("mistral", "phi3", "gemma3")
                                                 or kw.get("use_sliding_window")):
        s.append(f"win={kw['sliding_window']}")
    if family in ("qwen2", "qwen3") and kw.get("use_sliding_window"):
        s.append(f"mwl={kw['max_window_layers']}")
        if kw.get("layer_types"):
            s.append("types=" + "".join("S" if t[0] == "s" else "F" for t in kw["layer_types"]))
    if family == "gemma3":
        s.append("types=" + "".join("S" if t[0] == "s" else "F" for t in kw["layer_types"]))
        s.append(f"qpas={kw['query_pre_attn_scalar']} cap={kw['final_logit_softcapping']}")
    if kw.get("hidden_act", "silu") != "silu":
        s.append(kw["hidden_act"])
    if kw.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        s.append(kw["hidden_activation"])
    return " ".join(s)


# ------------------------------------------------------------------ checks
def gap_at_divergence(torch_model, prompt, got, want):
    """First differing step and HF's top-1/top-2 logit gap there (unpadded, no cache)."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            seq = prompt + want[:i]
            logits = torch_logits(torch_model, [seq])[0, -1]
            top = np.sort(logits)[::-1]
            return i, float(top[0] - top[1]), float(logits[a] - logits[b])
    return min(len(got), len(want)), None, None


def run_case(idx, seed):
    r = random.Random(seed * 1000 + idx)
    family = ["llama", "llama", "mistral", "qwen2", "qwen3", "gemma3", "gemma3", "phi3"][idx % 8]
    cls, kw = random_case(r, family)
    kind = r.choice(["bytes", "bos", "plain"])
    tok = tokenizer(kind)
    path = os.path.join(ROOT, f"case{idx:02d}")
    shutil.rmtree(path, ignore_errors=True)
    desc = f"#{idx:02d} {family:7s} tok={kind:5s} {describe(family, kw)}"
    res = {"desc": desc}
    try:
        cfg = cls(**kw, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                  pad_token_id=tok.pad_token_id)
        torch.manual_seed(idx)
        tm = transformers.AutoModelForCausalLM.from_config(cfg).eval()
        randomize(tm, seed * 1000 + idx)
        tm.save_pretrained(path)
        tok.save_pretrained(path)
    except Exception as e:  # noqa: BLE001
        res["error"] = f"HF build: {type(e).__name__}: {str(e)[:200]}"
        return res
    T = r.randint(40, 80) if not os.environ.get("LONG") else r.randint(130, 300)
    tokens = np.random.default_rng(idx).integers(0, VOCAB, (2, T), dtype=np.int32)
    res["T"] = T
    try:
        expected = torch_logits(tm, tokens)
        model, params, ours = loading.load_model(path)
        got = np.asarray(jax.jit(model.apply)({"params": params}, tokens))
        res["import"] = float(np.abs(got - expected).max())
    except Exception as e:  # noqa: BLE001
        res["error"] = f"import: {type(e).__name__}: {str(e)[:300]}"
        res["tb"] = traceback.format_exc()
        return res
    try:
        cfgm = hf.model_config_from_hf(path)
        out = os.path.join(ROOT, f"case{idx:02d}_export")
        shutil.rmtree(out, ignore_errors=True)
        hf.export(params, cfgm, path, out)
        back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
        res["export"] = float(np.abs(torch_logits(back, tokens) - expected).max())
        a, b = hf_tensors(path), hf_tensors(out)
        res["bitwise"] = sorted(a) == sorted(b) and all(
            a[n].dtype == b[n].dtype and np.array_equal(a[n], b[n]) for n in a)
        if not res["bitwise"]:
            res["bitwise_detail"] = (sorted(set(a) ^ set(b))[:4] or
                                     [n for n in a if not np.array_equal(a[n], b[n])][:4])
        res["cfg_rt"] = hf.model_config_from_hf(out) == cfgm
        if not res["cfg_rt"]:
            c2 = hf.model_config_from_hf(out)
            res["cfg_detail"] = {k: (getattr(cfgm, k), getattr(c2, k)) for k in cfgm.__dataclass_fields__
                                 if getattr(cfgm, k) != getattr(c2, k)}
    except Exception as e:  # noqa: BLE001
        res["export_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        res["tb"] = traceback.format_exc()
    try:
        hftok = transformers.AutoTokenizer.from_pretrained(path)
        want, enc = hf_greedy(tm, hftok, PROMPTS)
        prompts = ours.encode_texts(PROMPTS)
        same_prompts = all(row[len(row) - len(p):] == p
                           for row, p in zip(enc["input_ids"].tolist(), prompts))
        res["prompt_lens"] = [len(p) for p in prompts]
        if not same_prompts:
            res["gen"] = "PROMPT-ENCODING-DIFFERS"
            return res
        got_gen = generate(model, params, prompts, ours.eos_id, ours.pad_id,
                           max_new_tokens=NEW_TOKENS, temperature=0)
        res["gen"] = got_gen == want
        res["gen_lens"] = [len(g) for g in want]
        if got_gen != want:
            res["gen_detail"] = []
            for row, (p, g, w) in enumerate(zip(prompts, got_gen, want)):
                if g != w:
                    step, gap, ours_vs = gap_at_divergence(tm, p, g, w)
                    res["gen_detail"].append((row, step, gap, ours_vs))
    except Exception as e:  # noqa: BLE001
        res["gen_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        res["tb"] = traceback.format_exc()
    return res


def fmt(res):
    line = res["desc"]
    if res.get("error", "").startswith("HF build"):  # transformers itself refused the config
        return "skip " + line + f"\n      {res['error']}"
    if "error" in res:
        return line + f"\n      ERROR {res['error']}"
    line += f"\n      T={res['T']} import={res['import']:.2e}"
    if "export" in res:
        line += f" export={res['export']:.2e} bitwise={res['bitwise']} cfg_rt={res['cfg_rt']}"
        if not res["bitwise"]:
            line += f" {res['bitwise_detail']}"
        if not res["cfg_rt"]:
            line += f" {res['cfg_detail']}"
    if "export_error" in res:
        line += f" EXPORT-ERROR {res['export_error']}"
    if "gen" in res:
        line += f" gen_equal={res['gen']} prompts={res.get('prompt_lens')} hf_new={res.get('gen_lens')}"
        if res.get("gen_detail"):
            line += f" diverge(row,step,hf_top2_gap,hf_logit[ours]-hf_logit[hf])={res['gen_detail']}"
    if "gen_error" in res:
        line += f" GEN-ERROR {res['gen_error']}"
    bad = ("error" in res or "export_error" in res or "gen_error" in res
           or res.get("import", 0) >= 1e-5 or res.get("export", 0) >= 1e-5
           or res.get("bitwise") is False or res.get("cfg_rt") is False or res.get("gen") is not True)
    return ("FAIL " if bad else "ok   ") + line


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 32
    seed = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    only = [int(a) for a in sys.argv[3:]]
    try:
        for i in range(n):
            if only and i not in only:
                continue
            res = run_case(i, seed)
            print(fmt(res), flush=True)
            if "tb" in res and os.environ.get("TB"):
                print(res["tb"], flush=True)
    finally:
        shutil.rmtree(ROOT, ignore_errors=True)
