/* commands.h - the subcommand table of the moetax CLI (git's builtin/ style).
 * One file per subcommand under tools/, each defining cmd_<name>(argc, argv)
 * where argv[0] is the subcommand name. Add one X() line per subcommand. */
#ifndef MOETAX_TOOLS_COMMANDS_H
#define MOETAX_TOOLS_COMMANDS_H

#define MOETAX_COMMANDS(X) \
    X(gen, "write a random-weight (or dense-twin) model in llama.cpp's GGUF layout") \
    X(inspect, "show a GGUF file: metadata, tensors, totals, active bytes per token") \
    X(run, "generate text from a prompt, streaming, with prefill/decode speed") \
    X(eval, "evaluate token ids and write the logits (for comparing against a reference)") \
    X(perplexity, "perplexity over a text file or a folder of files (sliding window, like llama-perplexity)") \
    X(tokenize, "encode text with a GGUF file's tokenizer and print the token ids or pieces") \
    X(quantize, "convert a GGUF model's weights to another type (f16, bf16, q8_0, q4_0, q2_k..q6_k)") \
    X(profile, "run text through the model and write its routing profile (expert frequencies, transitions)") \
    X(tune, "choose the levers (threads, top-k, paging, expert precision, expert store, capacity factor) for this model and machine, quality measured") \
    X(report, "the bill of a run: tax share, phases, layers, workers, routing, from a ledger or trace (--html)") \
    X(serve, "an OpenAI-compatible HTTP server with continuous batching and live tax metrics (/metrics)") \
    X(bench, "benchmarks: mem (read bandwidth), kernels, io (O_DIRECT reads), and model prefill/decode")

#define X(name, help) int cmd_##name(int argc, char **argv);
MOETAX_COMMANDS(X)
#undef X

#endif
