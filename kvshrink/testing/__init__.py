"""Test and benchmark harness (like ``numpy.testing``): real servers started and stopped
(``launch``, over the child-process handling of ``processes``), a polling loop (``polling``), a
streaming OpenAI client that measures TTFT (``streaming_client``), what an ``lmcache server``
reports (``mp_observe``), stores derived from a shipped store file (``derived_stores``), the
real-model fixtures (``fixtures``) and the in-process runtime helpers (``inprocess``). Installed
with the product so that tests and benchmarks of an installed KVShrink can use it; the product
itself never imports it (tests/test_architecture.py)."""
