#!/usr/bin/env python3
"""Independent numpy reference for Gemma 3 (text, decoder only), kept outside the engine.

It reads a Gemma 3 GGUF with gguf.GGUFReader, dequantises every tensor to f32 with
gguf.quants.dequantize and runs the forward pass in plain numpy f32, written from the model's
definition and checked line by line against llama.cpp's gemma3 graph (the peer). It uses no code
of the engine, so the fixture it writes is an outside check on the engine's Gemma 3 path.

Run it with a Python that has numpy and gguf (pip install numpy gguf; nothing else is needed):

    python3 scripts/reference/gemma3.py                                  # print the results
    python3 scripts/reference/gemma3.py --check-llama \
        --write engine/tests/fixtures/gemma3-270m.json                    # regenerate the fixture

About 1.5 minutes on 2 cores (half of it dequantising), a few more with --check-llama; it needs
about 3 GiB of memory.

Prompts and the held-out text are tokenised by llama.cpp's `llama-tokenize` (BOS added, as the
file asks; special tokens such as <start_of_turn> parsed), never by the engine; build it with
`cmake --build target/tools/llama.cpp --target llama-tokenize` after `scripts/build-llama`.
`--check-llama` also runs `llama-completion` greedily (temperature 0, no chat mode) on each prompt,
checks that it tokenised the prompt to the same ids, and compares its 16 greedy ids with ours
(stored in the fixture as llama_cpp_greedy_ids). The exit status is 1 when they differ. It runs
llama.cpp with an f32 KV cache and flash attention off (LLAMA_ARGS below), the closest it comes to
this f32 reference: with its default f16 KV cache llama.cpp takes the second-best token at step 9
of the chat prompt, where this reference's gap is 0.46 between two logits near -2.4 (a flat,
low-confidence spot); with the f32 cache it agrees on all 16 tokens of every prompt.

What the fixture holds (all logits are this reference's, rounded to 1e-4):
  per prompt: text, prompt_ids, greedy_ids (16 argmax steps; generation does not stop at
    <eos>/<end_of_turn>), greedy_text, top5_first (id, logit) at the first generated step, and
    greedy_gaps (top-1 minus top-2 logit at each greedy step: a small gap is a near-tie, where a
    correct engine may legitimately pick the other token);
  heldout: the first 257 ids of data/text/heldout-eval.txt and the teacher-forced NLL of ids[1..257]
    (natural log; sum of -log softmax(logits after ids[i])[ids[i+1]] for i = 0..255, over 256), as
    the engine's `score` defines it, with the perplexity exp(mean).

Decisions, and the llama.cpp facts behind them (llama-cpp-python 0.3.36's vendored llama.cpp:
src/models/gemma3.cpp, src/llama-model.cpp, src/llama-hparams.{h,cpp}, src/llama-graph.cpp,
ggml/src/ggml-cpu/vec.h, conversion/gemma.py):
  * Embedding: the token_embd row times sqrt(n_embd) (sqrt(640) = 25.3), an f32 scale applied to
    token inputs only.
  * RMSNorm everywhere: x / sqrt(mean(x^2) + eps) * w, with eps from
    gemma3.attention.layer_norm_rms_epsilon (1e-6). The weights are used as stored: Gemma's
    "(1 + w)" is already folded in by the converter (conversion/gemma.py adds 1 to every tensor
    named *norm.weight). Seen in the file too: every norm weight of magnitude under 0.25
    (1703 of them) is a multiple of 1/256, which is what a bf16 value near -1 plus 1 gives; raw
    small bf16 weights would not be so coarse.
  * Attention: Q = x Wq, K = x Wk, V = x Wv, then RMSNorm of each 256-wide head of Q and of K
    (attn_q_norm, attn_k_norm, same eps), then RoPE on Q and K, then Q times f_attention_scale.
    llama.cpp sets that scale to 1/sqrt(head_dim) = 1/16 for every Gemma 3 size except 27B (where
    it is 1/sqrt(n_embd / n_head)); the file carries no query_pre_attn_scalar (for 270M that is
    256 anyway, so both readings agree). The attention itself then uses scale 1. 4 query heads
    share 1 KV head (GQA), head_dim 256 for K and V. No attention-logit soft-capping for gemma3.
  * RoPE: the NEOX (half-split) layout for LLM_ARCH_GEMMA3: dimension i pairs with i + 128,
    angle pos * base^(-2i/256), all 256 dimensions rotated (no rope.dimension_count key), no
    scaling. The base is rope_freq_base_train_swa on sliding-window layers, which defaults to
    10000 when the file has no gemma3.rope.freq_base_swa (this one has none), and
    gemma3.rope.freq_base (1e6) on the global layers.
  * Which layers are global: with gemma3.attention.sliding_window set, llama.cpp uses the period 6
    (unless gemma3.attention.sliding_window_pattern overrides it; absent here) and marks layer il
    as sliding when il % 6 < 5, so il is global exactly when (il + 1) % 6 == 0: layers 5, 11, 17.
  * Window: llama.cpp masks key position p0 for query position p1 when p1 - p0 >= n_swa
    (LLAMA_SWA_TYPE_STANDARD), on top of the causal mask. With n_swa = 512 a query at p sees keys
    p-511 .. p (512 keys, itself included). Global layers see 0 .. p.
  * After attention: attn_output, then post_attention_norm, then the residual add.
  * FFN: ffn_norm, then gelu(x Wgate) * (x Wup) (GeGLU; llama.cpp's GELU is the tanh form
    0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), read from an f16 table on CPU; here it is
    computed directly in f32), ffn_down, post_ffw_norm, then the residual add.
  * Output: output_norm, then the tied head (no output.weight in the file, so token_embd is used),
    and no final logit soft-capping: gemma3 only applies it when the file has
    final_logit_softcapping, which this one does not.
Everything runs in f32 (numpy matmul); RoPE angles are computed in f64 and rounded to f32, and
the log-softmax of the NLL is taken in f64 over the f32 logits.
"""

import argparse
import hashlib
import json
import math
import os
import struct
import subprocess
import sys
import tempfile
import time

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DEFAULT_MODEL = os.path.join(REPO, "models", "gemma-3-270m-q4_k_m.gguf")
DEFAULT_LLAMA_BIN = os.path.join(REPO, "target", "tools", "llama.cpp", "bin")
HELDOUT = "data/text/heldout-eval.txt"
N_GENERATE = 16
N_HELDOUT = 257
# llama-completion settings for --check-llama besides greedy/no-chat (see the header).
LLAMA_ARGS = ["-fa", "off", "-ctk", "f32", "-ctv", "f32"]

PROMPTS = [
    ("story", "Once upon a time, there was a little"),
    ("fact", "The largest planet in our solar system is"),
    ("chat", "<start_of_turn>user\nWrite a short poem about the sea.<end_of_turn>\n"
             "<start_of_turn>model\n"),
    ("digits", "Order #4521:  3 items  x  $12.50 = $37.50 (paid 2024-07-15, 09:30).\n"
               "Order #4522:"),
]


def field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


class Gemma3:
    def __init__(self, path):
        r = GGUFReader(path)
        arch = field(r, "general.architecture")
        if arch != "gemma3":
            raise SystemExit(f"{path}: architecture {arch!r}, expected gemma3")
        p = "gemma3."
        self.n_embd = int(field(r, p + "embedding_length"))
        self.n_layer = int(field(r, p + "block_count"))
        self.n_head = int(field(r, p + "attention.head_count"))
        self.n_head_kv = int(field(r, p + "attention.head_count_kv"))
        self.head_dim = int(field(r, p + "attention.key_length", self.n_embd // self.n_head))
        if int(field(r, p + "attention.value_length", self.head_dim)) != self.head_dim:
            raise SystemExit("value_length != key_length is not handled")
        self.eps = float(field(r, p + "attention.layer_norm_rms_epsilon"))
        self.base_global = float(field(r, p + "rope.freq_base", 10000.0))
        self.base_local = float(field(r, p + "rope.freq_base_swa", 10000.0))
        n_rot = int(field(r, p + "rope.dimension_count", self.head_dim))
        if n_rot != self.head_dim:
            raise SystemExit("partial RoPE is not handled")
        if field(r, p + "rope.scaling.type") not in (None, "none"):
            raise SystemExit("RoPE scaling is not handled")
        self.window = int(field(r, p + "attention.sliding_window", 0))
        pattern = field(r, p + "attention.sliding_window_pattern", 6)
        if self.window <= 0:
            self.is_swa = [False] * self.n_layer
        elif isinstance(pattern, list):
            self.is_swa = [bool(x) for x in pattern]
        else:
            n = int(pattern)
            self.is_swa = [n == 0 or il % n < n - 1 for il in range(self.n_layer)]
        if field(r, p + "final_logit_softcapping") or field(r, p + "attn_logit_softcapping"):
            raise SystemExit("logit soft-capping is not handled (gemma3 files normally have none)")
        # The 27B model scales queries by 1/sqrt(n_embd / n_head); every other size (this one
        # included) by 1/sqrt(head_dim).
        n_layer_27b = 62
        scale_dim = self.n_embd // self.n_head if self.n_layer == n_layer_27b else self.head_dim
        self.q_scale = np.float32(1.0 / math.sqrt(scale_dim))
        self.tokens = field(r, "tokenizer.ggml.tokens")
        self.token_type = field(r, "tokenizer.ggml.token_type")
        self.bos = int(field(r, "tokenizer.ggml.bos_token_id"))

        self.w = {}
        for t in r.tensors:
            a = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
            # numpy shape is the reverse of ggml's ne: a linear weight is (out, in).
            self.w[t.name] = np.ascontiguousarray(a.reshape([int(d) for d in reversed(t.shape)]))
        self.embd = self.w["token_embd.weight"]                    # (n_vocab, n_embd)
        self.head = self.w.get("output.weight", self.embd)          # tied when absent
        self.n_vocab = self.embd.shape[0]

    def rms_norm(self, x, w):
        ms = np.mean(x * x, axis=-1, keepdims=True, dtype=np.float32)
        return (x / np.sqrt(ms + np.float32(self.eps))) * w

    def rope(self, x, pos, base):
        # x: (T, heads, D); NEOX layout: rotate (x[i], x[i + D/2]) by pos * base^(-2i/D).
        d = x.shape[-1]
        half = d // 2
        inv = base ** (-np.arange(half, dtype=np.float64) * 2.0 / d)
        ang = pos.astype(np.float64)[:, None] * inv[None, :]
        cos = np.cos(ang).astype(np.float32)[:, None, :]
        sin = np.sin(ang).astype(np.float32)[:, None, :]
        x1, x2 = x[..., :half], x[..., half:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    @staticmethod
    def gelu_tanh(x):
        c = np.float32(math.sqrt(2.0 / math.pi))
        return np.float32(0.5) * x * (np.float32(1.0) + np.tanh(c * (x + np.float32(0.044715) * x * x * x)))

    def hidden(self, ids):
        """Final normed hidden states (T, n_embd) for a token sequence at positions 0..T-1."""
        ids = np.asarray(ids, dtype=np.int64)
        T = len(ids)
        pos = np.arange(T)
        H, Hkv, D = self.n_head, self.n_head_kv, self.head_dim
        x = self.embd[ids] * np.float32(math.sqrt(self.n_embd))
        dist = pos[:, None] - pos[None, :]                          # query pos - key pos
        causal = dist >= 0
        masks = {False: causal, True: causal & (dist < self.window)}
        for il in range(self.n_layer):
            L = lambda n: self.w[f"blk.{il}.{n}.weight"]  # noqa: E731
            swa = self.is_swa[il]
            base = self.base_local if swa else self.base_global
            h = self.rms_norm(x, L("attn_norm"))
            q = (h @ L("attn_q").T).reshape(T, H, D)
            k = (h @ L("attn_k").T).reshape(T, Hkv, D)
            v = (h @ L("attn_v").T).reshape(T, Hkv, D)
            q = self.rope(self.rms_norm(q, L("attn_q_norm")), pos, base) * self.q_scale
            k = self.rope(self.rms_norm(k, L("attn_k_norm")), pos, base)
            group = H // Hkv
            out = np.empty((T, H, D), dtype=np.float32)
            for hh in range(H):
                kh, vh = k[:, hh // group, :], v[:, hh // group, :]
                s = q[:, hh, :] @ kh.T                              # (T, T)
                s = np.where(masks[swa], s, np.float32(-np.inf))
                s = np.exp(s - s.max(axis=1, keepdims=True))
                s /= s.sum(axis=1, keepdims=True)
                out[:, hh, :] = s @ vh
            a = out.reshape(T, H * D) @ L("attn_output").T
            x = x + self.rms_norm(a, L("post_attention_norm"))
            h = self.rms_norm(x, L("ffn_norm"))
            f = self.gelu_tanh(h @ L("ffn_gate").T) * (h @ L("ffn_up").T)
            f = f @ L("ffn_down").T
            x = x + self.rms_norm(f, L("post_ffw_norm"))
        return self.rms_norm(x, self.w["output_norm.weight"])

    def logits(self, h):
        return h @ self.head.T

    def greedy(self, ids, n):
        """n argmax steps (recomputing the whole sequence each step: simple and exact)."""
        seq = list(ids)
        out, gaps, top5 = [], [], None
        for step in range(n):
            lg = self.logits(self.hidden(seq)[-1])
            order = np.argsort(-lg, kind="stable")[:5]
            if step == 0:
                top5 = [[int(i), round(float(lg[i]), 4)] for i in order]
            nxt = int(np.argmax(lg))
            assert nxt == int(order[0])
            gaps.append(round(float(lg[order[0]] - lg[order[1]]), 4))
            out.append(nxt)
            seq.append(nxt)
        return out, top5, gaps

    def nll(self, ids):
        """Teacher-forced sum and count of -log p(ids[i+1] | ids[..i]) for i = 0..len-2."""
        h = self.hidden(ids[:-1])
        total = 0.0
        for i in range(len(ids) - 1):
            lg = self.logits(h[i]).astype(np.float64)
            m = lg.max()
            lse = m + math.log(np.exp(lg - m).sum())
            total += lse - lg[ids[i + 1]]
        return total, len(ids) - 1

    def decode(self, ids):
        out = bytearray()
        for i in ids:
            piece, kind = self.tokens[i], int(self.token_type[i])
            if kind == 6 and piece.startswith("<0x") and piece.endswith(">"):   # byte token
                out.append(int(piece[3:-1], 16))
            else:
                out += piece.replace("\u2581", " ").encode("utf-8")
        return out.decode("utf-8", errors="replace")


def tokenize(llama_bin, model_path, text):
    exe = os.path.join(llama_bin, "llama-tokenize")
    if not os.path.exists(exe):
        raise SystemExit(f"{exe} is missing: cmake --build target/tools/llama.cpp --target llama-tokenize")
    # --stdin and --no-escape: the exact bytes; BOS comes from the file; special tokens parsed.
    res = subprocess.run([exe, "-m", model_path, "--stdin", "--ids", "--no-escape", "--log-disable"],
                         input=text.encode("utf-8"), capture_output=True, check=False)
    if res.returncode != 0:
        raise SystemExit(f"llama-tokenize failed:\n{res.stderr.decode(errors='replace')}")
    return json.loads(res.stdout.decode().strip().splitlines()[-1])


def llama_greedy(llama_bin, model_path, text, n):
    """llama-completion greedy on TEXT; returns the prompt ids it used followed by the ids it
    generated, read from the session file it saves (--prompt-cache-all stores the prompt and every
    generated token, the last one included)."""
    exe = os.path.join(llama_bin, "llama-completion")
    with tempfile.TemporaryDirectory() as d:
        sess = os.path.join(d, "session.bin")
        cmd = [exe, "-m", model_path, "-p", text, "--no-escape", "-n", str(n), "--temp", "0",
               "-no-cnv", "-c", "512", "-t", str(os.cpu_count() or 2), "--seed", "1",
               "--no-warmup", "--simple-io", "--prompt-cache", sess, "--prompt-cache-all"] + LLAMA_ARGS
        res = subprocess.run(cmd, capture_output=True, check=False)
        if res.returncode != 0:
            raise SystemExit(f"llama-completion failed:\n{res.stderr.decode(errors='replace')[-3000:]}")
        with open(sess, "rb") as f:
            magic, version, count = struct.unpack("<III", f.read(12))
            if magic != 0x6767736E:
                raise SystemExit("unexpected llama.cpp session file")
            toks = list(struct.unpack(f"<{count}i", f.read(4 * count)))
    return toks


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def dump(obj, indent=0):
    """JSON with objects indented and every list on one line."""
    pad = "  " * indent
    if isinstance(obj, dict):
        items = [f'{pad}  {json.dumps(k)}: {dump(v, indent + 1)}' for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(obj, list) and obj and isinstance(obj[0], dict):
        return "[\n" + ",\n".join(pad + "  " + dump(v, indent + 1) for v in obj) + "\n" + pad + "]"
    return json.dumps(obj, ensure_ascii=False)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--llama-bin", default=DEFAULT_LLAMA_BIN, help="llama.cpp's bin folder")
    ap.add_argument("--write", metavar="FIXTURE", help="write the fixture JSON here")
    ap.add_argument("--check-llama", action="store_true",
                    help="compare the greedy ids with llama-completion's")
    args = ap.parse_args()

    t0 = time.time()
    m = Gemma3(args.model)
    t_load = time.time() - t0
    print(f"loaded {args.model} in {t_load:.1f} s: {m.n_layer} layers, d={m.n_embd}, "
          f"heads {m.n_head}/{m.n_head_kv}x{m.head_dim}, vocab {m.n_vocab}, window {m.window}, "
          f"global layers {[i for i, s in enumerate(m.is_swa) if not s]}, "
          f"rope bases {m.base_local:g}/{m.base_global:g}, q scale {float(m.q_scale):g}")

    fixture = {
        "model": os.path.basename(args.model),
        "model_sha256": sha256(args.model),
        "generator": "scripts/reference/gemma3.py (numpy f32 reference; see its header)",
        "tokenizer": "llama.cpp llama-tokenize (BOS added, special tokens parsed)",
        "bos_id": m.bos,
        "n_generate": N_GENERATE,
        "prompts": [],
    }
    if args.check_llama:
        fixture["llama_cpp"] = ("llama-completion --temp 0 -no-cnv " + " ".join(LLAMA_ARGS) +
                                " (llama-cpp-python 0.3.36's llama.cpp, CPU)")
    all_match = True
    for name, text in PROMPTS:
        t1 = time.time()
        ids = tokenize(args.llama_bin, args.model, text)
        if ids[0] != m.bos:
            raise SystemExit(f"{name}: llama-tokenize did not add BOS: {ids}")
        gen, top5, gaps = m.greedy(ids, N_GENERATE)
        entry = {"name": name, "text": text, "prompt_ids": ids, "greedy_ids": gen,
                 "greedy_text": m.decode(gen), "top5_first": top5, "greedy_gaps": gaps}
        print(f"\n[{name}] {text!r} ({time.time() - t1:.1f} s)\n  prompt ids {ids}\n"
              f"  reference  {gen}\n  text       {m.decode(gen)!r}\n  top5 first {top5}\n"
              f"  gaps       {gaps}")
        if args.check_llama:
            toks = llama_greedy(args.llama_bin, args.model, text, N_GENERATE)
            peer_prompt, peer = toks[:len(ids)], toks[len(ids):]
            if peer_prompt != ids:
                print(f"  llama-completion tokenised the prompt differently: {peer_prompt}")
                all_match = False
            match = peer == gen[:len(peer)] and (len(peer) == N_GENERATE or
                                                  (peer and peer[-1] in (1, 106)))
            all_match &= match
            print(f"  llama.cpp  {peer}  {'MATCH' if match else 'DIFFERENT'}")
            entry["llama_cpp_greedy_ids"] = peer
        fixture["prompts"].append(entry)

    t1 = time.time()
    with open(os.path.join(REPO, HELDOUT), encoding="utf-8") as f:
        held = tokenize(args.llama_bin, args.model, f.read())[:N_HELDOUT]
    if len(held) < N_HELDOUT:
        raise SystemExit(f"{HELDOUT} has only {len(held)} tokens")
    total, count = m.nll(held)
    mean = total / count
    fixture["heldout"] = {"file": HELDOUT, "ids": held, "nll_sum": round(total, 4), "count": count,
                          "mean_nll": round(mean, 6), "perplexity": round(math.exp(mean), 4)}
    print(f"\n[heldout] {count} predictions: NLL sum {total:.4f}, mean {mean:.6f}, "
          f"perplexity {math.exp(mean):.4f} ({time.time() - t1:.1f} s)")
    print(f"total {time.time() - t0:.1f} s")

    if args.write:
        with open(args.write, "w", encoding="utf-8") as f:
            f.write(dump(fixture) + "\n")
        print(f"wrote {args.write}")
    if args.check_llama:
        print("greedy ids: " + ("all match llama.cpp" if all_match else "DIFFER from llama.cpp"))
        return 0 if all_match else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
