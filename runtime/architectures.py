"""One description per supported architecture: what differs between Llama, Mistral and Qwen2.

In the spirit of optimum's normalized configs, each family's decoder is the same Llama-shaped step
(``graphs/base_step.py`` reads the weights it is given, biases included); what a family changes is
named here, and the exporter (which models it accepts, the context cap, the stop tokens), ``validate``
(the model has the structure its description says) and the runtime (the chat template's variables)
ask this module. Nothing else tests an architecture name: a new Llama-family model is one more entry.

Pure data and plain Python: the lean runtime imports it, so it needs neither torch nor transformers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .errors import UnsupportedArchitectureError


@dataclass(frozen=True)
class Architecture:
    """What one model family changes against the shared Llama-shaped step."""

    name: str  # transformers' class, as config.json's ``architectures`` names it
    model_type: str  # config.json's ``model_type``
    gguf_arch: str  # a GGUF file's ``general.architecture``
    attention_bias: str  # "none", "qkv" (q/k/v projections only) or "config" (config.attention_bias decides)
    output: str  # "config": tie_word_embeddings decides whether the lm_head is the embedding table
    rope: str  # the position encoding the step implements for it
    sliding_window: str  # "none", "always" (config.sliding_window caps the context) or "use_sliding_window"
    norm: str = "rmsnorm"  # before attention and MLP, and at the end
    # Whether llama.cpp's converter reorders q_proj's and k_proj's rows per head in its GGUFs (for its rotary
    # layout), which a reader of the file's tensors undoes
    gguf_qk_permuted: bool = False
    # Token strings that end an assistant turn, where the vocabulary has them; added to the stop tokens
    # (a GGUF often names only one of them as its eos).
    end_of_turn: tuple[str, ...] = ()
    # The chat format its instruct models use, and that format's default system prompt (the template
    # carries its own; these describe it, and ``--chat`` with no system message gets it from the template).
    chat_format: str = ""
    default_system_prompt: str | None = None
    # Variables chat templates of this family test; rendered as given when the caller passes none.
    template_variables: Mapping[str, object] = field(default_factory=dict)
    # How its instruct models write tool calls where their chat template renders tools (runtime/tools.py's
    # FORMATS); "" where specdeploy renders tools generically whatever the template (the Hermes form).
    tool_call_format: str = ""

    def has_bias(self, config) -> bool:
        """Whether the q/k/v projections of a model with this ``config`` carry biases."""
        if self.attention_bias == "qkv":
            return True
        return self.attention_bias == "config" and bool(getattr(config, "attention_bias", False))

    def context_cap(self, config) -> int | None:
        """The sliding window that caps the context (the step attends over the whole cache), or None."""
        window = getattr(config, "sliding_window", None)
        if not window or self.sliding_window == "none":
            return None
        if self.sliding_window == "use_sliding_window" and not getattr(config, "use_sliding_window", False):
            return None
        return int(window)

    def tied_output(self, config) -> bool:
        return bool(getattr(config, "tie_word_embeddings", True))

    def check_config(self, config, where: str) -> None:
        """Refuse, in one sentence, what the shared step does not implement (a rope scaling, another norm)."""
        rope = getattr(config, "rope_scaling", None) or getattr(config, "rope_parameters", None) or {}
        kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, Mapping) else "default"
        if kind not in (None, "default"):
            raise UnsupportedArchitectureError(
                f"'{where}' uses '{kind}' rope scaling; specdeploy's {self.model_type} step implements plain rotary "
                "positions only.")

    def mismatches(self, model) -> list[str]:
        """Where a loaded transformers ``model`` differs from this description (empty when it fits):
        duck-typed, so this module needs no torch."""
        config, out = model.config, []
        attn = model.model.layers[0].self_attn
        want = self.has_bias(config)
        for proj in ("q_proj", "k_proj", "v_proj"):
            if (getattr(attn, proj).bias is not None) != want:
                out.append(f"{proj} {'lacks' if want else 'has'} a bias")
        tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        if tied != self.tied_output(config):
            out.append(f"the output is {'tied' if tied else 'untied'} against tie_word_embeddings")
        return out

    def describe(self, config) -> str:
        """One line for reports: the family and what it changes for this model."""
        cap = self.context_cap(config)
        parts = [self.model_type, "q/k/v biases" if self.has_bias(config) else "no biases",
                 "tied output" if self.tied_output(config) else "untied output", self.rope,
                 f"sliding window {cap}" if cap else "no sliding window", self.norm]
        if self.chat_format:
            parts.append(f"{self.chat_format} chat")
        return ", ".join(parts)


_TOOLS = {"tools": None, "documents": None}  # templates test them; a request's tools replace the None

ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture("LlamaForCausalLM", "llama", "llama", attention_bias="config", output="config",
                 rope="rotary (rope_theta)", sliding_window="none", gguf_qk_permuted=True,
                 end_of_turn=("<|eot_id|>", "<|im_end|>", "<|end_of_text|>"), template_variables=_TOOLS,
                 tool_call_format="llama3-json"),
    Architecture("MistralForCausalLM", "mistral", "llama", attention_bias="none", output="config",
                 rope="rotary (rope_theta)", sliding_window="always", end_of_turn=("</s>",),
                 chat_format="[INST]", template_variables=_TOOLS),
    Architecture("Qwen2ForCausalLM", "qwen2", "qwen2", attention_bias="qkv", output="config",
                 rope="rotary (rope_theta)", sliding_window="use_sliding_window",
                 end_of_turn=("<|im_end|>", "<|endoftext|>"), chat_format="ChatML",
                 default_system_prompt="You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
                 template_variables=_TOOLS, tool_call_format="hermes"),
)
SUPPORTED = tuple(a.name for a in ARCHITECTURES)


def gguf_architecture(gguf_arch: str, where: str = "the GGUF") -> Architecture:
    """The first description whose GGUF ``general.architecture`` is ``gguf_arch`` (Mistral's files say
    "llama", as Llama's do); UnsupportedArchitectureError in one sentence otherwise."""
    found = next((a for a in ARCHITECTURES if a.gguf_arch == gguf_arch), None)
    if found is None:
        raise UnsupportedArchitectureError(f"'{where}' holds a '{gguf_arch}' model; specdeploy supports "
                                           f"{', '.join(SUPPORTED)}.")
    return found


def architecture(config=None, *, name: str | None = None, where: str = "the model") -> Architecture:
    """The description of ``config`` (its ``architectures``, else its ``model_type``) or of ``name`` (a class
    or a model type); UnsupportedArchitectureError in one sentence otherwise."""
    names = [name] if name else list(getattr(config, "architectures", None) or [])
    model_type = name or getattr(config, "model_type", "")
    found = next((a for n in names for a in ARCHITECTURES if a.name == n), None)
    found = found or next((a for a in ARCHITECTURES if model_type and a.model_type == model_type), None)
    if found is None:
        what = (names[0] if names else model_type) or "unknown"
        raise UnsupportedArchitectureError(f"'{where}' is a {what} model; specdeploy supports {', '.join(SUPPORTED)}.")
    if config is not None:
        found.check_config(config, where)
    return found
