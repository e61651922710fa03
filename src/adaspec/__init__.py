"""adaspec: adaptive speculative decoding with output exactly the target model's."""

from adaspec.errors import AdaspecError, InputError, ModelStoreError
from adaspec.sampling import SamplingParams

__all__ = ["AdaspecError", "InputError", "ModelStoreError", "SamplingParams"]
__version__ = "0.1.0"
