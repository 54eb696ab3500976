#!/usr/bin/env bash
# One command from a fresh clone: set up .venv, export the embedded SmolLM2-135M-Instruct to a bundle
# for ONNX Runtime on this CPU (its own Q4_1 blocks with int8 activations: near-fp32 quality at
# llama.cpp's arithmetic; see docs/benchmarks.md), add the shipped Chimera draft and the model's own
# n-gram table (from its committed self-replies), validate against torch, then stream two prompts (a chat
# question and a summarization) with plain greedy decoding, auto (the default), Chimera, n-gram, prompt-lookup
# and suffix speculative decoding, each with its tokens/s, and check that every output equals plain. Idempotent.
# PRECISION=fp32 (or int4) picks another bundle.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
PRECISION="${PRECISION:-q4_1}"
if [ "$PRECISION" = fp32 ]; then BUNDLE="${BUNDLE:-bundles/smollm2}"; else BUNDLE="${BUNDLE:-bundles/smollm2-$PRECISION}"; fi
PROMPT="${PROMPT:-Explain in three sentences why the sky is blue.}"
current() {  # the bundle exists and has every base graph this specdeploy writes (exact trees taking rows of several
  # sequences, which batching runs, included)
  [ -f "$BUNDLE/manifest.json" ] && python -c "import sys
from specdeploy.runtime.bundle import read_manifest
m = read_manifest(sys.argv[1], verify=False)
sys.exit(m.tree_graph() is None or not m.tree_graph().rows_apart)" "$BUNDLE" 2>/dev/null
}
if current; then
  echo "[main] bundle $BUNDLE exists; reusing it (delete it or run 'specdeploy export base --force' to redo)" >&2
else
  [ -f "$BUNDLE/manifest.json" ] && echo "[main] bundle $BUNDLE lacks a base graph this version writes (an older export); exporting it again" >&2
  # the shipped Chimera reads base layers 1, 14 and 26 (EAGLE-3 fusion): the bundle outputs them
  specdeploy export base --precision "$PRECISION" --feature-layers eagle3 --out "$BUNDLE" --force
fi
specdeploy export draft --kind chimera --draft graphs/weights/chimera.safetensors "$BUNDLE"
specdeploy export draft --kind ngram --draft graphs/weights/self-replies.npz "$BUNDLE"
specdeploy validate "$BUNDLE"
OUT_DIR="$(mktemp -d)"
trap 'rm -rf "$OUT_DIR"' EXIT
# Two prompts: a chat question, and a summarization whose answer reuses its passage (where lookup pays).
SUMMARY_PROMPT="${SUMMARY_PROMPT:-Summarize the following passage in two sentences.

The history of the bicycle begins in the early nineteenth century, when inventors in Germany and France built \
wooden machines that riders pushed along with their feet. Pedals attached to the front wheel came decades later, \
and the chain drive that turns the rear wheel made the modern safety bicycle possible in the 1880s. Within a few \
years, cycling clubs had spread across Europe and North America, and women in particular found in the bicycle a \
new kind of independence.}"
run() {  # run TAG NAME [generate options...]: stream the completion, keep its text for the identity check
  local tag="$1" name="$2"; shift 2
  local prompt="$PROMPT"; [ "$tag" = summary ] && prompt="$SUMMARY_PROMPT"
  # stderr (the plan line before the text, the stats line after it) shares stdout's pipe, so the
  # lines keep their order on the terminal; the text alone is kept for the comparison.
  specdeploy generate "$BUNDLE" --chat --prompt "$prompt" --max-new-tokens 128 --threads "${THREADS:-2}" "$@" \
    2>&1 | tee "$OUT_DIR/$tag-$name.log"
  grep -v -e '^\[plan\] ' -e '^warning: ' -e '^-- [0-9]* tokens, ' "$OUT_DIR/$tag-$name.log" > "$OUT_DIR/$tag-$name.txt" || true
}
DRAFTS="auto chimera ngram prompt-lookup suffix"
for tag in chat summary; do
  echo "[main] $tag prompt, plain greedy decoding:" >&2
  run "$tag" plain --draft none
  for name in $DRAFTS; do
    case "$name" in
      auto) echo "[main] $tag prompt, auto (the default): per step lookup, n-grams, suffix, the Chimera draft or a plain step, whichever pays most:" >&2 ;;
      chimera) echo "[main] $tag prompt, Chimera speculative decoding (the shipped draft):" >&2 ;;
      ngram) echo "[main] $tag prompt, n-gram speculative decoding (prompt lookup or the model's own n-gram table, per step):" >&2 ;;
      prompt-lookup) echo "[main] $tag prompt, prompt-lookup speculative decoding (no trained draft):" >&2 ;;
      suffix) echo "[main] $tag prompt, suffix speculative decoding (this prompt's context; a cache of earlier outputs when serving):" >&2 ;;
    esac
    run "$tag" "$name" --draft "$name"
  done
done
for tag in chat summary; do
  for name in $DRAFTS; do
    if cmp -s "$OUT_DIR/$tag-plain.txt" "$OUT_DIR/$tag-$name.txt"; then
      echo "[main] $tag prompt: $name output is identical to plain greedy decoding" >&2
    else
      echo "[main] ERROR: $tag prompt: $name output differs from plain greedy decoding" >&2
      exit 1
    fi
  done
done
