"""
The reference implementation's `layer_config` module, kept as a face over the nanogns package: which layer
classes model.py builds with (`set_contextual_config`, nanogns/kinds/choice.py) and `convert(model)` for a
model built elsewhere (nanogns/conversion/convert.py).
"""

from nanogns.conversion.convert import convert  # noqa: F401
from nanogns.kinds.choice import (  # noqa: F401
    LayerConfig,
    config,
    get_layer_class,
    layer_classes,
    set_contextual_config,
    tracks_per_example_norms,
)
