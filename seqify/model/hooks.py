"""Module hooks: which hook dicts a module runs when called, and which hooks a conversion may leave behind."""

from __future__ import annotations

from typing import Any

from torch import nn

#: The hook dicts whose hooks a module runs when called (what conversion would drop).
HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
)
#: Those and the dicts of hooks registered with kwargs or always called.
ALL_HOOK_DICTS = HOOK_DICTS + (
    "_forward_hooks_with_kwargs",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks_always_called",
)


def recording_hook(hook: Any) -> bool:
    """A hook transformers 5 installs on a model's own modules at its first call that records hidden states
    (``transformers.utils.output_capturing``): it only appends outputs to a list the decorated forward
    returns, so torch.export captures what it records as graph outputs, and a converted model, which never
    runs that forward, has no use for it."""
    fn = getattr(hook, "__func__", hook)
    return getattr(fn, "__module__", None) == "transformers.utils.output_capturing"


def user_hooks(module: nn.Module) -> list[str]:
    """The hook dicts of ``module`` that hold a hook a flattening conversion would drop (recording hooks aside)."""
    return [h for h in HOOK_DICTS  # read once per replayed step: empty dicts cost one lookup each
            if (hooks := getattr(module, h, None)) and any(not recording_hook(f) for f in hooks.values())]
