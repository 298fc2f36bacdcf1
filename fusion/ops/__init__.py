"""The ops of the public API. Each is a torch.nn.Module with an OpSpec the planner reads."""
from fusion.ops.activation import Activation, GeGLU, SReLU, SwiGLU
from fusion.ops.base import Op, OpSpec, RunContext
from fusion.ops.elementwise import Bias, Clamp, Scale
from fusion.ops.linear import GroupLinear, Linear
from fusion.ops.quantize import QuantizeFP8Block, QuantizeMXFP8, QuantizeNVFP4
from fusion.ops.routing import Combine, Gather

__all__ = ["Op", "OpSpec", "RunContext", "GroupLinear", "Linear", "SwiGLU", "GeGLU", "SReLU", "Activation",
           "Clamp", "Scale", "Bias", "QuantizeMXFP8", "QuantizeNVFP4", "QuantizeFP8Block", "Gather", "Combine"]
