"""trainer/generate.py beyond greedy parity (tests/test_families.py has that, for every
family): the continuous-batching engine against transformers and against itself run
alone, the compile count under mixed traffic, traced sampling against numpy, stop strings,
and a sharded mesh against one device."""

import random
import threading

import jax
import numpy as np
import pytest
import torch

from tiny_hf import make_hf_dir
from trainer import generate as gen
from trainer import loading
from trainer.tokenizer import ByteTokenizer


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A random tiny HF Llama (GQA) dir, its torch model and meshlm's (model, params, tok)."""
    path = str(tmp_path_factory.mktemp("gen") / "llama")
    torch_model = make_hf_dir(path, "llama_gqa", seed=7)
    return path, torch_model, loading.load_model(path)


def hf_greedy_one(torch_model, prompt, new, eos_id):
    with torch.no_grad():
        out = torch_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(
            1, len(prompt), dtype=torch.long), max_new_tokens=new, do_sample=False,
            eos_token_id=eos_id, pad_token_id=eos_id)[0, len(prompt):].tolist()
    return out[:out.index(eos_id)] if eos_id in out else out


def run_all(engine, requests):
    """Submit every request at once; wait for all; their token lists."""
    engine.submit(*requests)
    return [list(r) for r in requests]


def test_engine_traffic_compiles_within_buckets_and_matches_alone_and_transformers(llama):
    """50 requests of random lengths, budgets and sampling settings through 4 slots: every
    greedy one equals transformers' greedy generation (and the same request run alone),
    a sampled one repeats under its seed, and the engine compiles at most one prefill per
    prompt bucket plus one decode step."""
    _, torch_model, (model, params, tok) = llama
    engine = gen.Engine(model, params, slots=4, max_len=128, max_queue=64)
    rng = random.Random(0)

    def request(greedy):
        prompt = [rng.randrange(3, 300) for _ in range(rng.randrange(1, 90))]
        settings = {} if greedy else dict(temperature=rng.choice([0.5, 1.0, 1.5]),
                                          top_k=rng.choice([0, 5, 50]),
                                          top_p=rng.choice([0.5, 0.9, 1.0]),
                                          seed=rng.randrange(1000))
        return gen.Request(prompt, rng.randrange(1, 128 - len(prompt) + 1 if greedy else 20),
                           stop_ids=[tok.eos_id], **settings)

    before = len(gen.COMPILES)
    reqs = [request(greedy=i % 3 == 0) for i in range(50)]
    outs = run_all(engine, reqs)
    compiled = gen.COMPILES[before:]
    assert len(compiled) <= len(gen.buckets(128)) + 1, compiled
    assert {name for name, _ in compiled} == {"prefill", "decode_step"}

    greedy = [(r, o) for r, o in zip(reqs, outs) if r.sampling.temperature[0] == 0]
    for r, out in greedy:
        assert r.finish_reason in ("stop", "length")
        assert len(out) == r.max_new_tokens or r.finish_reason == "stop"
    for r, out in greedy[:6]:  # transformers as the oracle (a few: it is slow)
        assert out == hf_greedy_one(torch_model, r.prompt, r.max_new_tokens, tok.eos_id)
    for r, out in greedy[6:10]:  # alone: an idle engine, nothing beside it
        assert list(engine.submit(gen.Request(r.prompt, r.max_new_tokens,
                                              stop_ids=[tok.eos_id]))) == out
    sampled = next((r, o) for r, o in zip(reqs, outs) if r.sampling.temperature[0] > 0)
    again = gen.Request(sampled[0].prompt, sampled[0].max_new_tokens, stop_ids=[tok.eos_id])
    again.sampling = sampled[0].sampling
    assert list(engine.submit(again)) == sampled[1]
    assert len(gen.COMPILES) - before <= len(gen.buckets(128)) + 1


def test_a_finished_request_frees_its_slot_at_once(llama):
    """Two slots, one long request and two short ones: the third starts as soon as the
    second ends, and finishes long before the first."""
    _, _, (model, params, _) = llama
    engine = gen.Engine(model, params, slots=2, max_len=128)
    order, lock = [], threading.Lock()

    def req(name, new):
        def emit(event):
            if isinstance(event, str):
                with lock:
                    order.append(name)
                r.events.put(event)
        r = gen.Request([5, 6, 7], new, emit=emit)
        return r

    long, short1, short2 = req("long", 100), req("short1", 3), req("short2", 3)
    engine.submit(long, short1, short2)
    for r in (long, short1, short2):
        list(r)
    assert order == ["short1", "short2", "long"]
    assert engine.steps < 100 + 3  # short2 ran beside long, not after it


def test_sample_filters_match_numpy():
    """Per-row temperature, top-k and top-p (traced, one compile): every sampled token lies
    in the set numpy computes; temperature 0 is argmax; a row's key is its own."""
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((4, 50)).astype(np.float32) * 3
    temperature = np.array([0.0, 1.0, 0.7, 1.3], np.float32)
    top_k = np.array([0, 3, 0, 10], np.int32)
    top_p = np.array([1.0, 1.0, 0.6, 0.8], np.float32)
    draw = jax.jit(gen._sample_rows)
    seen = [set() for _ in range(4)]
    for step in range(200):
        out = np.asarray(draw(logits, temperature, top_k, top_p, np.zeros(4, np.uint32),
                              np.arange(4, dtype=np.int32), np.full(4, step, np.int32)))
        for row in range(4):
            seen[row].add(int(out[row]))
    order = np.argsort(-logits, axis=-1)
    assert seen[0] == {int(order[0, 0])}
    assert seen[1] == set(order[1, :3].tolist())  # 200 draws from 3 tokens: all appear
    for row in (2, 3):
        x = logits[row] / temperature[row]
        keep = np.sort(x)[::-1][:top_k[row] or None]
        probs = np.exp(keep - keep.max()) / np.exp(keep - keep.max()).sum()
        nucleus = int(np.searchsorted(np.cumsum(probs), top_p[row]) + 1)
        allowed = set(order[row, :nucleus].tolist())
        assert seen[row] <= allowed and len(seen[row]) > 1
    # The same (seed, stream, step) gives the same token in any row of any batch.
    one = draw(logits[2:3], temperature[2:3], top_k[2:3], top_p[2:3], np.zeros(1, np.uint32),
               np.array([2], np.int32), np.array([7], np.int32))
    four = draw(logits, temperature, top_k, top_p, np.zeros(4, np.uint32),
                np.arange(4, dtype=np.int32), np.full(4, 7, np.int32))
    assert int(one[0]) == int(four[2])


def test_text_stream_cuts_at_stop_strings_and_holds_back_partial_ones():
    tok = ByteTokenizer()
    ids = list("héllo STOP more".encode())
    stream = gen.TextStream(tok, ["STOP", "zz"])
    pieces = []
    for i in ids:
        pieces.append(stream.add(i))
        if stream.stopped:
            break
    assert "".join(pieces) == "héllo " == stream.text() and stream.stopped
    assert "\ufffd" not in "".join(pieces)  # half of é was held back, never sent
    assert pieces[ids.index(ord("S"))] == ""  # "S" might start "STOP": held
    plain = gen.TextStream(tok, ["STOP"])
    sent = "".join(plain.add(i) for i in "no ST here".encode()) + plain.finish()
    assert sent == "no ST here" == plain.text() and not plain.stopped


def test_a_sharded_mesh_generates_the_single_device_tokens(llama):
    """Weights sharded by the training rules on a 1,2,4 mesh of the 8 CPU devices (tp=4
    beyond the 2 kv heads): the engine gives one device's tokens (the CLI test below
    covers batch generation on a mesh)."""
    path, _, (model, params, tok) = llama
    prompts = [[3, 40, 41, 42], [3] + list(range(100, 130)), [3, 7]]
    want = gen.generate(model, params, prompts, tok.eos_id, tok.pad_id, 24, temperature=0)
    assert sum(map(len, want)) > 24
    mesh = gen.mesh_from_flag("1,2,4", model.cfg)
    model8, params8, _ = loading.load_model(path, mesh=mesh)
    assert len(params8["layers_0"]["mlp"]["up_proj"]["kernel"].sharding.device_set) == 8
    engine = gen.Engine(model8, params8, slots=4, max_len=64, mesh=mesh)
    reqs = [gen.Request(p, 24, stop_ids=[tok.eos_id]) for p in prompts]
    assert run_all(engine, reqs) == want
    with pytest.raises(gen.ConfigError, match="--slots=3 must be a positive multiple"):
        gen.Engine(model8, params8, slots=3, max_len=64, mesh=mesh)


def test_generate_cli_on_a_mesh_with_a_stop_string(llama, cli):
    """The command line: --mesh and --stop give the in-process tokens, cut at the stop."""
    path, _, (model, params, tok) = llama
    prompt = tok.encode_texts(["The with"])
    reply = tok.decode(gen.generate(model, params, prompt, tok.eos_id, tok.pad_id, 12,
                                    temperature=0)[0])
    stop = next(reply[i:i + 2] for i in range(4, len(reply)) if reply[i:i + 2].strip())
    out = cli("generate", f"--checkpoint={path}", "--prompt=The with", "--max_new_tokens=12",
              "--temperature=0", "--mesh=1,2,4", f"--stop={stop}", devices=8).stdout
    assert out.rstrip() == ("The with" + reply.split(stop)[0]).rstrip()
    assert len(reply.split(stop)[0]) < len(reply)
