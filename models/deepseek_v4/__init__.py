"""DeepSeek-V4 for amct_ext: config, float reference, checkpoint loading, quant wrappers, adapter.

Nothing here registers with transformers' Auto classes: transformers >= 5.10 owns the model_type
``deepseek_v4`` (see casebook/deepseek-v4.md, "two DeepseekV4 classes")."""
from .configuration import DeepseekV4Config
from .modeling import DeepseekV4ForCausalLM
from .binding import V4_BINDING  # noqa: F401  (registers V4 with amct_ext.base.model_binding)

__all__ = ["DeepseekV4Config", "DeepseekV4ForCausalLM", "load_checkpoint_model"]


def __getattr__(name):
    # loading pulls in the checkpoint reader; import it on first use
    if name == "load_checkpoint_model":
        from .loading import load_checkpoint_model

        return load_checkpoint_model
    raise AttributeError(name)
