"""``QuantizedLinear``: a drop-in ``nn.Linear`` whose weight is stored in ``bits``-bit codes (``weights.codec``).

Forward at 4 bits on CUDA (``esm_turbo.kernels.weights``): up to :data:`KERNEL_ROWS` rows, the input is rotated per
group (``x_rot = x_g Πᵀ``, one launch, unless its producer handed the rotation over: ``weights.fusion``) and the fused
kernel multiplies it by each pass's packed codes, adding the bias (and applying :attr:`QuantizedLinear.activation`)
in its epilogue; past it, the weight is dequantized once in the original domain (one launch a pass) and multiplied by
cuBLAS. Elsewhere and at other widths: the input rotated in one batched product, the rotated weight decoded in its
dtype, one matmul. FastEsm, which takes weight tensors, gets them from :meth:`QuantizedLinear.dequantize`.
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops import use_kernels
from .codec import QuantPass, WeightQuantConfig, quantize_weight, rotation

#: most rows a 4-bit forward on CUDA multiplies with the fused kernel; more dequantize the weight and call cuBLAS
#: (``esm-turbo bench weights``: the fused kernel reads the codes once, the dequantized weight serves many rows)
KERNEL_ROWS = 16


class QuantizedLinear(nn.Module):
    """x [..., N] → [..., M]. Buffers per pass p: ``codes{p}`` [M, N·bits/8] uint8, ``scales{p}`` [M, G] fp16,
    ``codebook{p}`` [2^bits] fp16; the rotation Π [d, d] is rebuilt from ``seed`` (float32, not stored); ``bias`` [M]
    or None."""

    def __init__(self, in_features: int, out_features: int, bits: int, group: int, passes: int, seed: int,
                 bias: bool = True):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group, self.passes, self.seed = bits, group, passes, seed
        groups = in_features // group
        for p in range(passes):
            self.register_buffer(f"codes{p}", torch.zeros(out_features, in_features * bits // 8, dtype=torch.uint8))
            self.register_buffer(f"scales{p}", torch.zeros(out_features, groups, dtype=torch.float16))
            self.register_buffer(f"codebook{p}", torch.zeros(1 << bits, dtype=torch.float16))
        self._rot: torch.Tensor | None = None  # Π [d, d] float32, built from the seed on first use (not stored)
        self._turns: dict = {}  # Π and Πᵀ as the kernels take them, per device (:meth:`_turn`)
        self.shared: SharedInput | None = None  # the linears of the same input this one is multiplied with
        self.offload = None  # weights.offload.ResidualOffload holding the residual pass in host memory, if any
        self.activation: str | None = None  # "gelu": ESM-2's GELU applied to the output (in the kernel's epilogue)
        self.given: tuple | None = None  # (x, its version, x rotated) from the producer of x (``weights.fusion``)
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: WeightQuantConfig, seed: int) -> "QuantizedLinear":
        passes, d = quantize_weight(linear.weight, config, seed)
        q = cls(linear.in_features, linear.out_features, config.bits, d, len(passes), seed, linear.bias is not None)
        for p, qp in enumerate(passes):
            getattr(q, f"codes{p}").copy_(qp.codes)
            getattr(q, f"scales{p}").copy_(qp.scales)
            getattr(q, f"codebook{p}").copy_(qp.codebook)
        if linear.bias is not None:
            q.bias.data.copy_(linear.bias.detach().float())
        return q.to(linear.weight.device)

    def _apply(self, fn, recurse: bool = True):
        """``.to(dtype)`` casts the bias; scales and codebooks stay fp16 (their stored precision); an offloaded residual
        pass stays a view of its slot."""
        super()._apply(fn, recurse)
        for p in range(self.passes):
            for name in (f"scales{p}", f"codebook{p}"):
                buf = getattr(self, name)
                if buf.dtype != torch.float16:
                    setattr(self, name, buf.to(torch.float16))
        if self.offload is not None:
            self.offload.bind(self)
        return self

    def _pass(self, p: int) -> QuantPass:
        return QuantPass(getattr(self, f"codes{p}"), getattr(self, f"scales{p}"), getattr(self, f"codebook{p}"))

    def _residual_ready(self) -> None:
        """Before the residual pass is read: its copy waited for where it is offloaded (``weights.offload``)."""
        if self.offload is not None and self.passes > 1:
            self.offload.ready(self)

    def rotated_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """Ŵ_rot [M, N] in ``dtype``: every pass decoded and summed (rotated domain)."""
        self._residual_ready()
        w = self._pass(0).decode(self.out_features, self.in_features, self.bits, dtype)
        for p in range(1, self.passes):
            w = w + self._pass(p).decode(self.out_features, self.in_features, self.bits, dtype)
        return w

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Ŵ [M, N] in the original domain (``Ŵ_rot`` groups times Π), in ``dtype`` (default the bias's)."""
        dtype = dtype or (self.bias.dtype if self.bias is not None else torch.float32)
        if self.bits == 4 and use_kernels(self.codes0):
            self._residual_ready()
            from ..kernels.weights import dequantize_triton
            w = None
            for p in range(self.passes):
                w = dequantize_triton(*self._pass(p).tensors(), dtype if p == self.passes - 1 else torch.float32,
                                      rotation=self._turn(self.codes0.device)[0], prev=w)
            return w
        m, n, d = self.out_features, self.in_features, self.group
        w = self.rotated_weight(torch.float32).view(m, n // d, d) @ self._rotation(self.codes0.device)
        return w.view(m, n).to(dtype)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight [M, N] (built on each access), for code that reads ``linear.weight``."""
        return self.dequantize()

    def rotate_input(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., N] → x_rot [..., N]: each group of d channels times Πᵀ."""
        d = self.group
        rot = self._rotation(x.device)
        return (x.float().reshape(*x.shape[:-1], self.in_features // d, d) @ rot.T).reshape(x.shape).to(x.dtype)

    def _rotation(self, device: torch.device) -> torch.Tensor:
        if self._rot is None:
            self._rot = rotation(self.group, self.seed)
        if self._rot.device != device:
            self._rot = self._rot.to(device)
        return self._rot

    def _turn(self, device: torch.device) -> tuple:
        """(Π, Πᵀ) on ``device`` as the kernels take them (``kernels.weights.sign_matrix``), made once."""
        if device not in self._turns:
            from ..kernels.weights import sign_matrix
            rot = self._rotation(device)
            self._turns[device] = (sign_matrix(rot), sign_matrix(rot.T))
        return self._turns[device]

    def input_turn(self, device: torch.device) -> tuple:
        """Πᵀ as the kernels take it: how this linear's input is rotated (``kernels.weights.rotate_triton``)."""
        return self._turn(device)[1]

    def forward(self, x: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., N] → [..., M]; ``add`` [..., M] (a block's input, its skip connection) added to the output, in the
        kernel's epilogue on the fused path (not with an activation)."""
        if add is not None and self.activation is not None:
            raise ValueError("a linear adds a block's input or applies an activation, not both")
        if self.bits == 4 and use_kernels(x):
            flat = x.reshape(-1, self.in_features)
            if flat.shape[0] > KERNEL_ROWS:  # many rows: the weight dequantized once, then cuBLAS
                return self._finish(torch.nn.functional.linear(
                    x, self.dequantize(x.dtype), None if self.bias is None else self.bias.to(x.dtype)), add)
            if self.shared is not None:  # with the other linears of this input, in one launch
                return self._finish(self.shared.output(self, x), add)
            from ..kernels.weights import rotate_triton
            self._residual_ready()
            x_rot = given_rotation(self, x)
            if x_rot is None:
                x_rot = rotate_triton(flat, self.input_turn(x.device))
            y = kernel_passes(x_rot, [self._pass(p).tensors() for p in range(self.passes)], self.bias,
                              None if add is None else add.reshape(-1, self.out_features),
                              self.activation == "gelu", x.dtype)
            return y.view(*x.shape[:-1], self.out_features)
        y = self.rotate_input(x) @ self.rotated_weight(x.dtype).T
        return self._finish(y + self.bias.to(x.dtype) if self.bias is not None else y, add)

    def _finish(self, y: torch.Tensor, add: torch.Tensor | None) -> torch.Tensor:
        """y with :attr:`activation` applied (none, or ESM-2's GELU as transformers computes it), or ``add`` added."""
        if add is not None:
            return y + add
        if self.activation is None:
            return y
        if self.activation != "gelu":
            raise ValueError(f"unknown activation {self.activation!r}: None or 'gelu'")
        from transformers.models.esm.modeling_esm import gelu
        return gelu(y)

    def nbytes(self) -> int:
        """Stored bytes of the weight (codes, scales, codebooks; the rotation is a seed)."""
        return sum(self._pass(p).nbytes() for p in range(self.passes))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group={self.group}, passes={self.passes}" + (f", activation={self.activation}"
                                                               if self.activation else ""))


class SharedInput:
    """Linears that read the same input (an attention layer's query, key and value), multiplied together on CUDA at
    up to :data:`KERNEL_ROWS` rows: the input rotated once for each (one launch), then one matmul launch over their
    stacked codes, scales, codebooks and biases (``kernels.weights.matmul_triton``'s parts). The members' code and
    scale buffers become views of the stacks, so nothing is held twice; a member moved or reloaded since is stacked
    again. The first member called with an input computes every member's output; the others, called with the same
    tensor (unchanged), take theirs from it without a launch (in a captured CUDA graph too)."""

    def __init__(self, members: list[QuantizedLinear]):
        if not self.fits(members):
            raise ValueError("linears of one input share a launch only at 4 bits with the same shapes and passes")
        self.members = members
        self._stacks: dict | None = None
        self._last: tuple | None = None  # (input, its version, the stacked output)
        self.given: tuple | None = None  # (x, its version, x rotated for each member) from the producer of x
        for m in members:
            m.shared = self

    @staticmethod
    def fits(members: list[QuantizedLinear]) -> bool:
        first = members[0]
        return len(members) > 1 and all(
            isinstance(m, QuantizedLinear) and m.bits == 4 and (m.in_features, m.out_features, m.group, m.passes)
            == (first.in_features, first.out_features, first.group, first.passes)
            and (m.bias is None) == (first.bias is None) for m in members)

    def _stacked(self) -> dict:
        """The stacks on the members' device: each pass's codes, scales and codebooks concatenated along their first
        axis (codebooks [P·16]), the rotations [P, d, d], the biases. Made, and the members' buffers turned into views
        of them, unless every member's buffers are still those views."""
        first, names = self.members[0], [f"{kind}{p}" for p in range(self.members[0].passes)
                                         for kind in ("codes", "scales", "codebook")]
        st = self._stacks
        if st is None or any(getattr(m, name).data_ptr() != st[name][i * len(st[name]) // len(self.members)].data_ptr()
                             for name in names for i, m in enumerate(self.members)):
            st = {}
            for name in names:
                if first.offload is not None and name in ("codes1", "scales1"):  # host-held: the slot's view
                    st[name] = first.offload.stacked(self.members, name)
                    continue
                st[name] = torch.cat([getattr(m, name) for m in self.members])
                step = len(st[name]) // len(self.members)
                for i, m in enumerate(self.members):
                    setattr(m, name, st[name][i * step:(i + 1) * step])
            turns = [m._turn(first.codes0.device)[1] for m in self.members]
            if len({c for _, c in turns}) != 1:
                raise ValueError("the members' rotations differ in scale")
            st["turn"] = (torch.stack([sign for sign, _ in turns]), turns[0][1])
            self._stacks, self._last = st, None
        if first.bias is not None:
            of = [(m.bias.data_ptr(), m.bias._version) for m in self.members]
            if st.get("bias_of") != of:
                st["bias"], st["bias_of"] = torch.cat([m.bias.detach() for m in self.members]), of
        return st

    def input_turn(self, device: torch.device) -> tuple:
        """The members' Πᵀ stacked [P, d, d] as the kernels take them (``kernels.weights.rotate_triton``)."""
        return self._stacked()["turn"]

    def output(self, member: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
        """``member``'s forward of x [..., N] (→ [..., M]), computed with the other members' in one launch."""
        last = self._last
        if last is None or last[0] is not x or last[1] != x._version:
            last = self._last = (x, x._version, self.product(x))
        rows = member.out_features
        i = next(k for k, m in enumerate(self.members) if m is member)
        return last[2][:, i * rows:(i + 1) * rows].view(*x.shape[:-1], rows)


    def product(self, x: torch.Tensor, gelu: bool = False, add: torch.Tensor | None = None) -> torch.Tensor:
        """Every member's output of x [..., K] side by side, [N, ΣM] (N: x's rows; member i's in columns
        [i·M, (i + 1)·M)), in one rotation launch (none where x's producer handed it over) and one matmul launch a
        pass; ``add`` [N, ΣM] added in the first pass's epilogue, or with ``gelu``
        ESM-2's GELU applied in the last's."""
        from ..kernels.weights import rotate_triton
        first = self.members[0]
        first._residual_ready()
        st = self._stacked()
        x_rot = given_rotation(self, x)
        if x_rot is None:
            x_rot = rotate_triton(x.reshape(-1, first.in_features), st["turn"])
        return kernel_passes(x_rot, [(st[f"codes{p}"], st[f"scales{p}"], st[f"codebook{p}"])
                                     for p in range(first.passes)], st.get("bias"), add, gelu, x.dtype)


def kernel_passes(x_rot: torch.Tensor, passes: list[tuple], bias: torch.Tensor | None, add: torch.Tensor | None,
                  gelu: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """The fused 4-bit kernel (``kernels.weights.matmul_triton``) pass by pass over x_rot ([N, K], or [P, N, K] for P
    stacked linears) and each pass's (codes, scales, codebook): [N, M] in ``out_dtype``. The first pass adds ``add``
    [N, M] (a block's input), the last the bias and, with ``gelu``, ESM-2's GELU; the passes between them sum in
    float32."""
    from ..kernels.weights import matmul_triton
    y = None if add is None else add.contiguous()
    for p, tensors in enumerate(passes):
        last = p == len(passes) - 1
        y = matmul_triton(x_rot, *tensors, bias=bias if last else None, prev=y, gelu=last and gelu,
                          out_dtype=out_dtype if last else torch.float32)
    return y


def given_rotation(consumer: QuantizedLinear | SharedInput, x: torch.Tensor) -> torch.Tensor | None:
    """The rotation of x that x's producer made along with it (``consumer.given``), if x is that same, unchanged
    tensor; else None."""
    given = consumer.given
    return given[2] if given is not None and given[0] is x and given[1] == x._version else None
