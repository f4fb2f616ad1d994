"""The serving stack behind `+experiment=serving` and `benchmarks.serving_dtype`: a real vLLM
server's lifetime (`server`), its streaming client and metrics (`client`), `vllm bench serve`
as the load driver (`bench`), the prompts and the summary, and the guarded process groups
(`guard`, `watchdog`) that let no child outlive the experiment. It imports the library
(kvnotes) and nothing of the harness: experiments/serving.py drives it."""
