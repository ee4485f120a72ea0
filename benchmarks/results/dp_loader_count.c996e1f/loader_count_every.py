import sys, time, argparse, torch, torch.nn.functional as F
sys.path.insert(0, "examples")
import autopar as dist, train_gpt as G
torch.set_num_threads(1)
p = argparse.ArgumentParser(); G.add_model_args(p); args = p.parse_args([])
mesh = dist.ProcessMesh([[0],[1]], dim_names=["dp","mp"])
data = list(G.batches(args, 4))
xs, ys = (torch.cat(t) for t in zip(*data))
xs, ys = xs.repeat(60, 1), ys.repeat(60, 1)
base = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xs, ys), batch_size=args.batch)
every = int(sys.argv[1])
res = {"mean": [], "count": []}
for rep in range(6):
  for name in ("mean", "count"):
    count = (lambda b: b[1].numel()) if name == "count" else None
    m, o = G.build(args, mesh)
    loader = dist.shard_dataloader(base, mesh, shard_dims="dp", count_items=count)
    it = iter(loader); steps = []
    for i in range(200):
        t0 = time.perf_counter(); x, y = next(it)
        logits = m(x).reshape(-1, args.vocab)
        if count is None: loss = F.cross_entropy(logits, y.reshape(-1))
        else: loss = F.cross_entropy(logits, y.reshape(-1), reduction="sum") / loader.num_items_in_batch
        loss.backward(); o.step(); o.zero_grad()
        if i % every == 0: loss.item()
        t2 = time.perf_counter()
        if i >= 20: steps.append(t2 - t0)
    res[name].append(sum(steps) / len(steps))
if dist.get_rank() == 0:
    r = [c / m for c, m in zip(res["count"], res["mean"])]
    print("every", every, "count/mean per rep", [round(x, 3) for x in r], "mean ms", [round(x*1e3, 2) for x in res["mean"]])
