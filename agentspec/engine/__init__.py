"""The engine: where a committed token's bits are decided.

Loading (:mod:`.load`), the target and its KV (:mod:`.target`), the fixed-width forward
(:mod:`.forward`), the static KV and its attention (:mod:`.kv`), the prefix cache of earlier
calls' rows (:mod:`.prefix`) and the CPU allocator's settings (:mod:`.malloc`)."""
