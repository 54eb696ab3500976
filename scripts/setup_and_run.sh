#!/usr/bin/env bash
# One command from a fresh clone: set up .venv, export the embedded SmolLM2-135M-Instruct to a bundle,
# validate it against torch, then stream a speculative generation with its tokens/s. Idempotent.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
BUNDLE="${BUNDLE:-bundles/smollm2}"
PROMPT="${PROMPT:-Explain in three sentences why the sky is blue.}"
if [ -f "$BUNDLE/manifest.json" ]; then
  echo "[main] bundle $BUNDLE exists; reusing it (delete it or run 'specdeploy export base --force' to redo)" >&2
else
  specdeploy export base --out "$BUNDLE"
fi
specdeploy validate "$BUNDLE"
echo "[main] plain greedy decoding:" >&2
specdeploy generate "$BUNDLE" --chat --prompt "$PROMPT" --max-new-tokens 128 --threads "${THREADS:-2}"
echo "[main] speculative decoding (prompt lookup; identical output):" >&2
specdeploy generate "$BUNDLE" --chat --prompt "$PROMPT" --max-new-tokens 128 --threads "${THREADS:-2}" \
  --draft prompt-lookup
