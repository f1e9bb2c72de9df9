"""What the tests and the benchmarks both use to run the product: a tiny seeded Llama
(`tiny_model`), the CLIs as processes on free ports (`cli_harness`), the protocol fuzzer
(`fuzzing`) and the device the target runs on (`device_under_test`). Tests never import
benchmarks and benchmarks never import tests (tests/test_layering.py); this package imports
neither."""
