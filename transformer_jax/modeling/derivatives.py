"""Derivatives for the operations that carry a backward pass of their own.

The bf16 weight products (`matmul`), the CPU kernels' attention (`attention`) and the chunked
attention (`chunked_attention`) each compute their gradients their own way: transposed copies, a
backward kernel, a recomputing loop. A `jax.custom_vjp` would say so, but JAX's forward mode
(`jax.jvp`, `jax.jacfwd`, `jax.linearize`) refuses to pass one. Instead the operation is a
`jax.custom_jvp` whose tangent is a primitive made here, linear in the tangents, with a
transpose rule that is the hand-written backward pass: forward mode evaluates the tangent, and
reverse mode, which JAX derives by transposing the tangent, runs the backward pass as before.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _abstract(fn):
    @functools.lru_cache(maxsize=512)
    def shape_of(signature, params):
        out = jax.eval_shape(functools.partial(fn, **dict(params)),
                             *(jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in signature))
        return out.shape, out.dtype

    def abstract(*avals, **params):
        # The output's shape and dtype follow from the operands' and the parameters: traced once
        # per combination (a model binds the same products in every layer), not at every bind.
        key = (tuple((a.shape, a.dtype) for a in avals), tuple(sorted(params.items())))
        try:
            hash(key)
        except TypeError:
            shape, dtype = shape_of.__wrapped__(*key)
        else:
            shape, dtype = shape_of(*key)
        # The first operand's type but for shape and dtype: inside `jax.shard_map` the manual
        # mesh axes it varies over, which `bind` made every operand's; no sharding of its own.
        first = avals[0]
        return first.update(shape=shape, dtype=dtype, weak_type=False,
                            sharding=first.sharding.update(spec=jax.sharding.PartitionSpec()))
    return abstract


def _varying(x) -> frozenset:
    """The manual mesh axes `x` varies over (inside `jax.shard_map` with check_vma), else none."""
    axis_type = getattr(jax.typeof(x), "manual_axis_type", None)
    return frozenset(getattr(axis_type, "varying", None) or ())


def vary_like(x, *refs):
    """`x` (a pytree) cast to vary over the manual mesh axes that any of `refs` varies over: inside
    `jax.shard_map` (check_vma), a loop's initial carry of fresh zeros is invariant while the body
    makes it vary with the inputs, and JAX refuses the mismatch. Elsewhere `x` itself."""
    axes = frozenset().union(*map(_varying, refs))

    def cast(a):
        missing = axes - _varying(a)
        return jax.lax.pcast(a, tuple(sorted(missing)), to="varying") if missing else a

    return jax.tree.map(cast, x) if axes else x


def bind(prim, *args, **params):
    """``prim.bind(*args, **params)`` with every operand cast to vary over the manual mesh axes
    that any of them varies over, as JAX's own primitives do inside `jax.shard_map`: the
    transpose of that cast sums an invariant operand's cotangent over those axes."""
    return prim.bind(*vary_like(list(args), *args), **params)


def map_over_mapped(prim):
    """A `jax.vmap` rule that binds `prim` once per element of the mapped axis (`lax.map`): the
    mapped arguments are sliced, the others captured whole rather than stacked once per element."""
    def batch(args, dims, **params):
        mapped = [i for i, d in enumerate(dims) if d is not None]

        def one(xs):
            full = list(args)
            for i, x in zip(mapped, xs):
                full[i] = x
            out = bind(prim, *full, **params)
            return tuple(out) if prim.multiple_results else out

        out = jax.lax.map(one, [jnp.moveaxis(args[i], dims[i], 0) for i in mapped])
        return (out, [0] * len(out)) if prim.multiple_results else (out, 0)

    return batch


def bilinear(name: str, product, lhs_transpose, rhs_transpose, batched):
    """A primitive for ``product(a, b, **params)``, linear in each operand, whose transposes (the
    backward products) are ``lhs_transpose(g, b, a_aval, **params)`` (the cotangent of a) and
    ``rhs_transpose(g, a, b_aval, **params)`` (that of b), and which `jax.vmap` maps by
    ``batched(a, a_dim, b, b_dim, **params) -> (out, out_dim)``. The tangents of a product of
    two such operands are two more such products."""
    from jax.extend.core import Primitive
    from jax.interpreters import ad, batching, mlir

    prim = Primitive(name)
    prim.def_impl(product)
    prim.def_abstract_eval(_abstract(product))
    mlir.register_lowering(prim, mlir.lower_fun(product, multiple_results=False))
    ad.defbilinear(prim, lambda g, a, b, **params: lhs_transpose(g, b, a.aval, **params),
                   lambda g, a, b, **params: rhs_transpose(g, a, b.aval, **params))
    batching.primitive_batchers[prim] = lambda args, dims, **params: batched(
        args[0], dims[0], args[1], dims[1], **params)
    return prim


def is_zero(tangent) -> bool:
    """Whether a custom JVP rule's tangent (with ``symbolic_zeros=True``) is JAX's symbolic zero."""
    return isinstance(tangent, jax.custom_derivatives.SymbolicZero)


def bilinear_tangent(prim, primals, tangents, **params):
    """The tangent of ``prim(x, w)`` (a `bilinear` primitive) at `primals`: ``prim(dx, w) +
    prim(x, dw)``, skipping JAX's symbolic zeros (a custom JVP with ``symbolic_zeros=True``)."""
    (x, w), (dx, dw) = primals, tangents
    terms = (([] if is_zero(dx) else [bind(prim, dx, w, **params)])
             + ([] if is_zero(dw) else [bind(prim, x, dw, **params)]))
    if not terms:
        out = jax.eval_shape(functools.partial(bind, prim, **params), x, w)
        return jnp.zeros(out.shape, out.dtype)
    return terms[0] if len(terms) == 1 else terms[0] + terms[1]


def linear_tangent(name: str, tangent, transpose, num_tangents: int):
    """A primitive for ``tangent(*primals, *tangents, **params)``, an operation's output tangent,
    linear in its last `num_tangents` arguments, whose transpose is ``transpose(g, *primals,
    **params) -> cotangents of the tangents`` (the operation's backward pass). Its own JVP (for
    higher derivatives of the tangent) is `tangent`'s, taken by JAX; `jax.vmap` maps it one call
    per element."""
    from jax.extend.core import Primitive
    from jax.interpreters import ad, batching, mlir

    prim = Primitive(name)
    prim.def_impl(tangent)
    prim.def_abstract_eval(_abstract(tangent))
    mlir.register_lowering(prim, mlir.lower_fun(tangent, multiple_results=False))

    def transpose_rule(g, *args, **params):
        primals, tangents = args[:-num_tangents], args[-num_tangents:]
        assert not any(ad.is_undefined_primal(p) for p in primals), "transposed in a primal"
        if type(g) is ad.Zero:  # no cotangent flows back: None, JAX's zero for each
            return [None] * len(args)
        cts = transpose(g, *primals, **params)
        return [None] * len(primals) + [ct if ad.is_undefined_primal(t) else None
                                         for ct, t in zip(cts, tangents)]

    def jvp(primals, tangents, **params):
        tangents = tuple(ad.instantiate_zeros(t) for t in tangents)
        return jax.jvp(functools.partial(tangent, **params), tuple(primals), tangents)

    ad.primitive_transposes[prim] = transpose_rule
    ad.primitive_jvps[prim] = jvp
    batching.primitive_batchers[prim] = map_over_mapped(prim)
    return prim
