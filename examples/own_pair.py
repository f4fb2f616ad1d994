import sys, kvnotes as kv  # python examples/own_pair.py [MODEL]: your own pair, every instrument
model = kv.load(sys.argv[1] if len(sys.argv) > 1 else "llama", dtype="float32")
rule = "\nIf the badge is red, reply Alpha; otherwise reply Beta.\n"
shots = "Ana's badge is red: Alpha.\nTom's badge is green: Beta.\nLi's badge is red: Alpha.\n"
ask = lambda colour: [{"role": "user", "content": f"The badge is {colour}.{rule}{shots}What do you reply? One word."}]
pair = kv.Pair.from_prompts(model, ask("red"), ask("blue"), answers=(" Alpha", " Beta"), spans={"rule": rule.strip()})
print(kv.recoveries(model, pair)[["condition", "effect", "recovery"]])
pmap = kv.patch_map(model, pair)
print(pmap.nlargest(8, "recovery")[["position", "token", "segment", "recovery"]])
attr = kv.attribution_map(model, pair)
print("attribution vs exact: spearman", round(attr.attrs["spearman"], 3), "top-8 overlap", attr.attrs["top_overlap"])
ko = kv.knockout(model, pair, n_random=16)
print("knockout reversion", round(ko.attrs["reversion"], 2), "random", round(ko.attrs["reversion_random"], 2), "p", round(ko.attrs["p_random"], 3))
print(kv.patch_map(model, pair, over="layer")[["layer", "recovery"]].round(2).T.to_string())
