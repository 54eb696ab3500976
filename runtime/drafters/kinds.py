"""The draft kinds: the one list that the drafters, the exporter's commands and its trainers read."""

from __future__ import annotations

HEADS_KINDS = ("medusa", "cerberus")  # Medusa-style heads over the base's last hidden state
TRAINED_KINDS = ("chimera", *HEADS_KINDS)  # drafts with trained weights, stored in a bundle
NGRAM = "ngram"  # prompt lookup + the base model's own n-gram table (no weights: a table from its replies)
HYBRID = "hybrid"  # prompt lookup + a trained draft in one tree; "hybrid:<kind>" picks the model (chimera)
SUFFIX = "suffix"  # this request's context and earlier requests' outputs (a cache shared across requests)
AUTO = "auto"  # per step: lookup/n-grams, suffix, the bundle's trained draft, or a plain step, by value per cost
CERBERUS_NOGATE = "cerberus-nogate"  # the Cerberus heads with the gate off (always draft)
TRAINED_DRAFTS = (*TRAINED_KINDS, CERBERUS_NOGATE)  # --draft names that run a trained draft (alone or in hybrid:KIND)
PROMPT_LOOKUP = "prompt-lookup"
NONE = "none"  # plain decoding
DRAFTS = (NONE, AUTO, PROMPT_LOOKUP, NGRAM, SUFFIX, *TRAINED_DRAFTS, HYBRID)  # what --draft accepts (and hybrid:KIND)


def draft_name_error(name: str) -> str | None:
    """Why ``name`` is not something ``--draft`` accepts, in one sentence; None when it is."""
    if name in DRAFTS:
        return None
    if name.startswith(HYBRID + ":"):
        if name.partition(":")[2] in TRAINED_DRAFTS:
            return None
        return f"'{name}': the hybrid's model must be one of {', '.join(TRAINED_DRAFTS)}."
    return f"Unknown draft '{name}'; choose one of {', '.join(DRAFTS)}, or hybrid:KIND."
