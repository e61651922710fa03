"""adaspec: adaptive speculative decoding with output exactly the target model's."""

from adaspec.engine.sampling import SamplingParams
from adaspec.errors import AdaspecError, InputError, ModelStoreError

__all__ = ["AdaspecError", "InputError", "ModelStoreError", "SamplingParams"]
__version__ = "0.1.0"
