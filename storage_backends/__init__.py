"""LMCache storage backends (installed as ``kvshrink.storage_backends``).

Needs the ``lmcache`` extra: without it, importing this package raises
:class:`~kvshrink.errors.MissingExtraError` (``kvshrink cache serve needs lmcache: pip install
'kvshrink[lmcache]'``). The check imports nothing (:func:`kvshrink.extras.check`)."""

from kvshrink.extras import check

check("lmcache")
