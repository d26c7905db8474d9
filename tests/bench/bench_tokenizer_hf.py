#!/usr/bin/env python3
"""bench_tokenizer_hf.py: lunar's tokenizer vs Hugging Face tokenizers, encode_batch on the same
texts with the same thread count, measured in one run.

    python3 tests/bench/bench_tokenizer_hf.py [--lunar build/lunar] [--threads 2] [--reps 5]
                                              [--file PATH [--doc-bytes 4096]]

Developer-machine benchmark (needs `pip install tokenizers`; CI never runs it). The texts are
the fixture corpus (tests/fixtures/tokenizer/corpus_glm.bin: ~11k texts of every kind, special
tokens, CJK, emoji, invalid UTF-8 ...; HF gets the same bytes, its invalid UTF-8 texts as
decoded with errors="replace") or a text file cut into documents, as bench_tokenizer.lua does.
HF runs in this process with RAYON_NUM_THREADS set before tokenizers is imported; lunar runs
tests/bench/bench_tokenizer.lua with threads=N. Each side: one warm-up pass, then the best of
--reps passes. Prints both and the ratios (lunar speed / HF speed; > 1 means lunar is faster).
"""
import argparse
import json
import os
import struct
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def fixture_texts(path):
    d = open(path, "rb").read()
    pos = 8
    hl, = struct.unpack_from("<I", d, pos)
    nvar = len(json.loads(d[pos + 4:pos + 4 + hl])["variants"])
    pos += 4 + hl
    n, = struct.unpack_from("<I", d, pos)
    pos += 4
    texts = []
    for _ in range(n):
        cat, flags, ln = struct.unpack_from("<BBI", d, pos)
        pos += 6
        text = d[pos:pos + ln]
        pos += ln
        for _ in range(nvar):
            k, = struct.unpack_from("<I", d, pos)
            pos += 4 + 2 * k
        if flags & 2:
            k, = struct.unpack_from("<I", d, pos)
            pos += 4 + k
        if not flags & 1:
            texts.append(text)
    return texts


def file_docs(path, doc_bytes):
    s = open(path, "rb").read()
    docs, i = [], 0
    while i < len(s):
        j = s.find(b"\n", i + doc_bytes)
        j = len(s) - 1 if j < 0 else j
        docs.append(s[i:j + 1])
        i = j + 1
    return docs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lunar", default=os.path.join(REPO, "build", "lunar"))
    ap.add_argument("--tokenizer", default=os.path.join("tests", "fixtures", "tokenizer", "glm"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--file")
    ap.add_argument("--doc-bytes", type=int, default=4096)
    args = ap.parse_args()
    os.chdir(REPO)
    os.environ["RAYON_NUM_THREADS"] = str(args.threads)
    import tokenizers   # after RAYON_NUM_THREADS: the thread pool reads it when it starts
    from tokenizers import Tokenizer

    raw = file_docs(args.file, args.doc_bytes) if args.file else \
        fixture_texts(os.path.join("tests", "fixtures", "tokenizer", "corpus_glm.bin"))
    texts = [t.decode("utf-8", "replace") for t in raw]
    nbytes = sum(len(t) for t in raw)
    tok = Tokenizer.from_file(os.path.join(args.tokenizer, "tokenizer.json")
                              if os.path.isdir(args.tokenizer) else args.tokenizer)
    ntok = sum(len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False))   # warm-up

    def best(fn):
        b = float("inf")
        for _ in range(args.reps):
            t0 = time.perf_counter()
            fn()
            b = min(b, time.perf_counter() - t0)
        return b

    hf = {}
    hf["encode_batch"] = best(lambda: tok.encode_batch(texts, add_special_tokens=False))
    if hasattr(tok, "encode_batch_fast"):
        hf["encode_batch_fast"] = best(lambda: tok.encode_batch_fast(texts, add_special_tokens=False))
    for k, s in hf.items():
        print(json.dumps({"impl": "hf tokenizers " + tokenizers.__version__, "mode": k, "threads": args.threads,
                          "texts": len(texts), "bytes": nbytes, "tokens": ntok, "seconds": round(s, 6),
                          "mb_per_s": round(nbytes / s / 1e6, 2), "tokens_per_s": round(ntok / s)}))

    cmd = [args.lunar, os.path.join("tests", "bench", "bench_tokenizer.lua"), "tokenizer=" + args.tokenizer,
           "threads=%d" % args.threads, "reps=%d" % args.reps]
    if args.file:
        cmd += ["file=" + args.file, "doc_bytes=%d" % args.doc_bytes]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    lunar = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    for r in lunar:
        print(json.dumps(r))
    hf_best = min(hf.values())
    for r in lunar:
        if r["tokens"] != ntok:
            print("note: token counts differ (lunar %d, HF %d): the texts with invalid UTF-8 differ after "
                  "HF's replacement" % (r["tokens"], ntok))
        print("ratio lunar %s / HF encode_batch: %.2fx; / HF fastest (%s): %.2fx" % (
            r["mode"], hf["encode_batch"] / r["seconds"], min(hf, key=hf.get), hf_best / r["seconds"]))


if __name__ == "__main__":
    sys.exit(main())
