"""Training throughput of 12-layer PerformerLM widths: python results/sweep/throughput.py THREADS
dim,heads,dim_head,m,seq_len,batch,ff_mult ... (the width measurement of the cpu20m sweep)."""
import sys, time, torch
from linear_rope import PerformerLM, ModelConfig
torch.set_num_threads(int(sys.argv[1]))
for spec in sys.argv[2:]:
    dim, heads, dh, m, seq, bs, ff = map(int, spec.split(","))
    torch.manual_seed(0)
    model = PerformerLM(ModelConfig(dim=dim, depth=12, heads=heads, dim_head=dh, nb_features=m, seq_len=seq, ff_mult=ff, position="rope"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 256, (bs, seq + 1))
    def step():
        logits = model(ids[:, :-1]); loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), ids[:, 1:].reshape(-1))
        opt.zero_grad(); loss.backward(); opt.step()
    for _ in range(3): step()
    t = time.perf_counter(); n = 10
    for _ in range(n): step()
    dt = (time.perf_counter() - t) / n
    print(f"{spec}: params {model.num_params()/1e6:.2f}M  {dt*1000:.0f} ms/step  {bs*seq/dt:.0f} B/s  20M bytes: {20e6/(bs*seq/dt)/60:.0f} min", flush=True)
