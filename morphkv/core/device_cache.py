"""The MLX path of ``MorphKVCache`` (``engine="mlx"``): attention and selection in one graph.

An update is held (``_held``) until its queries come: the attention hook calls ``attend``,
which feeds the update in pieces ending at the eviction grid (``DeviceEngine.piece``): each
piece is written into the storage, attended once (``morphkv.core.attention``: the output and
the rows the rule reads from the same softmax), observed by the engine, and an eviction due at
its end runs before the next piece. So every query sees what token-by-token feeding would
store, and the storage never holds more than ``budget + 1`` rows, inside a long prefill too.
Without the hook (keys as proxy queries, a cache used alone) ``update_and_fetch`` returns
[stored + new] for mlx_lm's attention and the pieces are fed at the next update or read,
without output. Nothing here reads an MLX array on the host.
"""

from __future__ import annotations

import mlx.core as mx

from . import device_proxy, device_schedule, proxy_schedule, quant, storage
from .attention import attend, self_rows
from .device import DeviceEngine, move

REPLACED = "replaced"  # a held decode token written into its victim's slot


class DevicePath:
    """Mixed into ``MorphKVCache``; uses its storage (``morphkv.core.storage``) and config."""

    _held = None  # (keys, values as stored, keys and values as given, written rows)

    def _device_update(self, keys: mx.array, values: mx.array):
        B, H, C, D = keys.shape
        stored_keys = storage.store_form(keys, self.config)
        stored_values = storage.store_form(values, self.config)
        if C == 0:
            return self._fetch() if self.keys is not None else (stored_keys, stored_values)
        self._settle_device()
        if self.engine is None:
            self.engine = DeviceEngine(self.config, B, H, D, self.config.scoring == "attention")
            self.engine.stored_keys = self._stored_float_keys
            if not isinstance(stored_keys, tuple):
                self.engine.key_bytes = stored_keys.dtype.size
        engine = self.engine
        if C == 1 and engine.due and engine.block == 1 and device_schedule.fits(engine):
            slot = engine.replace().reshape(B, H, 1, 1)  # the token takes the victim's slot
            put = lambda p, n: mx.put_along_axis(p, slot, n, axis=2)  # noqa: E731
            self.keys = quant.apply(put, self.keys, stored_keys)
            self.values = quant.apply(put, self.values, stored_values)
            self._held = (stored_keys, stored_values, keys, values, REPLACED)
            self.offset += 1
            return self._fetch()
        if C == 1 and self._proxy_step(stored_keys, stored_values):
            self._held = (stored_keys, stored_values, keys, values, REPLACED)
            self.offset += 1
            return self._fetch()
        self._evict_due()
        written = 0
        if engine.piece(C) == C:  # one piece: written in place now, fetched as a view
            self._write(stored_keys, stored_values, engine.slots)
            written = C
            fetched = self._fetch(engine.slots + C)
        elif self.keys is None:
            fetched = stored_keys, stored_values
        else:
            old = self._fetch()
            fetched = tuple(quant.apply(lambda a, b: mx.concatenate([a, b], axis=2), o, s)
                            for o, s in zip(old, (stored_keys, stored_values), strict=True))
        self._held = (stored_keys, stored_values, keys, values, written)
        self.offset += C
        return fetched

    def _proxy_step(self, key, value) -> bool:
        """The due eviction and this token at once, one compiled call (``core.device_proxy``),
        when the engine fits it; False (nothing done) otherwise."""
        engine = self.engine
        if not (engine.due and device_proxy.fits(engine, self.config)):
            return False
        state = engine.proxy
        if state is None or not state.valid(engine):  # another path moved the storage
            state = engine.proxy = device_proxy.ProxyState(engine, self.keys)
        self.keys, self.values = device_proxy.step(engine, (self.keys, self.values), state,
                                                   key, value)
        return True

    def _write(self, keys, values, start: int) -> None:
        end = start + quant.dims(keys)[2]
        self.engine.reserve(end)  # ``full`` grows; else the most a piece needs is there
        if self.keys is None:
            self.keys = storage.zeros(keys, quant.dims(keys)[0], self.engine.capacity)
            self.values = storage.zeros(values, quant.dims(values)[0], self.engine.capacity)
        elif quant.dims(self.keys)[2] < self.engine.capacity:
            self.keys = storage.grow(self.keys, self.engine.capacity)
            self.values = storage.grow(self.values, self.engine.capacity)
        quant.assign(self.keys, start, end, keys)
        quant.assign(self.values, start, end, values)

    def _quant(self):
        c = self.config
        return None if c.kv_bits is None else (c.kv_group_size, c.kv_bits)

    def _float_keys(self, n: int):
        """The first n stored keys as floats (R, n, D)."""
        keys = storage.floats(storage.fetch(self.keys, n), self.config)
        return keys.reshape(self.engine.rows, n, -1)

    def _float_values(self, start: int, end: int):
        """Stored values rows [start, end) as floats (R, end - start, Dv)."""
        v = storage.floats(storage.fetch(self.values, end, start), self.config)
        return v.reshape(self.engine.rows, end - start, -1)

    def _stored_float_keys(self):
        return self._float_keys(self.engine.slots)

    def _evict_due(self) -> None:
        engine = self.engine
        if engine is None or not engine.due:
            return
        proxy_window = engine.window_rule and engine.ring is None
        src, dst = engine.evict(self._float_keys(engine.slots) if proxy_window else None,
                                self._float_values)
        B, H = engine.B, engine.H
        src, dst = (x.reshape(B, H, -1, 1) for x in (src, dst))
        self.keys = quant.apply(lambda x: move(x, src, dst, 2), self.keys)
        self.values = quant.apply(lambda x: move(x, src, dst, 2), self.values)

    def attend(self, queries, scale: float, mask=None, sinks=None):
        """The attention output of the held update for ``queries`` (B, n_heads, C, D), the
        update fed to the engine on the way."""
        held, self._held = self._held, None
        if held is None:
            raise RuntimeError("MorphKVCache.attend: no update is waiting for its queries")
        self.engine.scale = float(scale)
        return self._feed(held, queries, sinks)

    def _settle_device(self) -> None:
        """Feed a held update that no attention came for (keys as proxy queries)."""
        held, self._held = self._held, None
        if held is None:
            return
        if self.engine.real:
            raise RuntimeError("attention scoring: the cache was read before its queries came")
        self._feed(held, None, None)

    def _feed(self, held, queries, sinks):
        stored_keys, stored_values, keys, values, written = held
        engine, C = self.engine, keys.shape[2]
        if written is REPLACED:  # already written and observed (``DeviceEngine.replace``)
            if queries is None:
                return None
            return attend(queries, self.keys, self.values, engine.slots, engine.scale, sinks,
                          self._quant())[0]
        if not written and device_schedule.fits(engine):
            return self._feed_scheduled(stored_keys, stored_values, queries, sinks)
        if not written and C > 1 and device_proxy.fits(engine, self.config):
            return self._feed_scheduled(stored_keys, stored_values, queries, sinks,
                                        proxy_schedule.schedule)
        outputs, i = [], 0
        proxy = not written and device_proxy.fits(engine, self.config)
        while i < C:
            if proxy and self._proxy_step(*(storage.fetch(s, i + 1, i)
                                            for s in (stored_keys, stored_values))):
                if queries is not None:
                    outputs.append(attend(queries[:, :, i : i + 1], self.keys, self.values,
                                          engine.slots, engine.scale, sinks, self._quant())[0])
                i += 1
                continue
            self._evict_due()
            k = engine.piece(C - i)
            n0, n = engine.slots, engine.slots + k
            if not written:
                self._write(*(storage.fetch(s, i + k, i) for s in (stored_keys, stored_values)), n0)
            rows = None
            if queries is not None:
                out, rows = attend(queries[:, :, i : i + k], self.keys, self.values, n,
                                   engine.scale, sinks, self._quant())
                outputs.append(out)
            if engine.needs_rows and not engine.real:
                rows = self_rows(self._float_keys(n), n, k, engine.scale)
            engine.observe(k, rows)
            i += k
        if queries is None:
            return None
        return outputs[0] if len(outputs) == 1 else mx.concatenate(outputs, axis=2)

    def _feed_scheduled(self, new_keys, new_values, queries, sinks, decide=None):
        """A chunk whose evictions need no attention (``core.device_schedule``; keys as
        proxy queries: ``core.proxy_schedule``)."""
        self._evict_due()
        if self.keys is None:
            cap = self.engine.capacity
            self.keys = storage.zeros(new_keys, quant.dims(new_keys)[0], cap)
            self.values = storage.zeros(new_values, quant.dims(new_values)[0], cap)
        out, (self.keys, self.values) = device_schedule.feed(
            self.engine, (self.keys, self.values), (new_keys, new_values), queries, sinks,
            self._quant(), decide)
        return out
