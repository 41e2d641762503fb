"""A GGUF model's weights held as the file stores them, and the CPU products over them.

:mod:`.formats` reads GGUF's quantized blocks into the native layout, :mod:`.native` builds
and loads the products (``qmm.cpp``), :mod:`.model` assembles the transformers model around
them; :mod:`.quantize` quantizes a float checkpoint at load into the same layout. The engine's
forward (:class:`~agentspec.engine.forward.Forward`) runs such a model as it runs any other:
the products are the modules' own.
"""
