#!/usr/bin/env bash
# One command from a fresh clone: set up .venv, export the embedded SmolLM2-135M-Instruct to a bundle
# for ONNX Runtime on this CPU (its own Q4_1 blocks with int8 activations: near-fp32 quality at
# llama.cpp's arithmetic; see docs/benchmarks.md), add the shipped Chimera draft and the model's own
# n-gram table (from its committed self-replies), validate against torch, then stream a generation with
# plain greedy decoding, Chimera, n-gram and prompt-lookup speculative decoding, each with its tokens/s,
# and check that the four outputs are identical. Idempotent.
# PRECISION=fp32 (or int4) picks another bundle.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
PRECISION="${PRECISION:-q4_1}"
if [ "$PRECISION" = fp32 ]; then BUNDLE="${BUNDLE:-bundles/smollm2}"; else BUNDLE="${BUNDLE:-bundles/smollm2-$PRECISION}"; fi
PROMPT="${PROMPT:-Explain in three sentences why the sky is blue.}"
if [ -f "$BUNDLE/manifest.json" ]; then
  echo "[main] bundle $BUNDLE exists; reusing it (delete it or run 'specdeploy export base --force' to redo)" >&2
else
  # the shipped Chimera reads base layers 1, 14 and 26 (EAGLE-3 fusion): the bundle outputs them
  specdeploy export base --precision "$PRECISION" --feature-layers eagle3 --out "$BUNDLE"
fi
specdeploy export draft --kind chimera --draft graphs/weights/chimera.safetensors "$BUNDLE"
specdeploy export draft --kind ngram --draft graphs/weights/self-replies.npz "$BUNDLE"
specdeploy validate "$BUNDLE"
OUT_DIR="$(mktemp -d)"
trap 'rm -rf "$OUT_DIR"' EXIT
run() {  # run NAME [generate options...]: stream the completion, keep its text for the identity check
  local name="$1"; shift
  # stderr (the plan line before the text, the stats line after it) shares stdout's pipe, so the
  # lines keep their order on the terminal; the text alone is kept for the comparison.
  specdeploy generate "$BUNDLE" --chat --prompt "$PROMPT" --max-new-tokens 128 --threads "${THREADS:-2}" "$@" \
    2>&1 | tee "$OUT_DIR/$name.log"
  grep -v -e '^\[plan\] ' -e '^warning: ' -e '^-- [0-9]* tokens, ' "$OUT_DIR/$name.log" > "$OUT_DIR/$name.txt" || true
}
echo "[main] plain greedy decoding:" >&2
run plain
echo "[main] Chimera speculative decoding (the shipped draft):" >&2
run chimera --draft chimera
echo "[main] n-gram speculative decoding (prompt lookup or the model's own n-gram table, per step):" >&2
run ngram --draft ngram
echo "[main] prompt-lookup speculative decoding (no trained draft):" >&2
run prompt-lookup --draft prompt-lookup
echo "[main] suffix speculative decoding (this prompt's context; a cache of earlier outputs when serving):" >&2
run suffix --draft suffix
echo "[main] auto: per step, lookup, n-grams, suffix, the Chimera draft or a plain step, whichever pays most:" >&2
run auto --draft auto
for name in chimera ngram prompt-lookup suffix auto; do
  if cmp -s "$OUT_DIR/plain.txt" "$OUT_DIR/$name.txt"; then
    echo "[main] $name output is identical to plain greedy decoding" >&2
  else
    echo "[main] ERROR: $name output differs from plain greedy decoding" >&2
    exit 1
  fi
done
