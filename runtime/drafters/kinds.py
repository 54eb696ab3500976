"""The draft kinds: the one list that the drafters, the exporter's commands and its trainers read."""

from __future__ import annotations

HEADS_KINDS = ("medusa", "cerberus")  # Medusa-style heads over the base's last hidden state
TRAINED_KINDS = ("chimera", *HEADS_KINDS)  # drafts with trained weights, stored in a bundle
NGRAM = "ngram"  # prompt lookup + the base model's own n-gram table (no weights: a table from its replies)
HYBRID = "hybrid"  # prompt lookup + a trained draft in one tree; "hybrid:<kind>" picks the model (chimera)
SUFFIX = "suffix"  # this request's context and earlier requests' outputs (a cache shared across requests)
AUTO = "auto"  # per step: lookup/n-grams, suffix, the bundle's trained draft, or a plain step, by value per cost
DRAFTS = ("none", AUTO, "prompt-lookup", NGRAM, SUFFIX, *TRAINED_KINDS, "cerberus-nogate", HYBRID)  # what --draft accepts
