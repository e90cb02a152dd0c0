/* dashboard.c - the page GET / serves: one self-contained HTML file (no CDN,
 * no build step). A prompt box that streams a completion from
 * /v1/completions, and the live tax from /metrics polled every second: the
 * seconds per ledger phase of each interval stacked (tax phases red, work
 * green), batch size and tokens/s, over the last 5 minutes. ?prompt=TEXT
 * starts a completion at load (for headless tests); the key field is sent as
 * a Bearer token when the server has one. */
#include "server/dashboard.h"

static const char page[] =
    "<!doctype html><html><head><meta charset=\"utf-8\"><title>moetax serve</title>\n"
    "<style>body{font:14px system-ui,sans-serif;margin:1.5em;max-width:70em}textarea{width:100%;height:5em;"
    "font:13px monospace}pre{background:#f4f4f4;padding:.8em;white-space:pre-wrap;min-height:3em}"
    "canvas{border:1px solid #ccc;width:100%;height:220px}.row span{margin-right:1.5em}</style></head><body>\n"
    "<h2>moetax serve</h2>\n"
    "<textarea id=\"prompt\">def __init__(self</textarea><br>\n"
    "max_tokens <input id=\"max\" type=\"number\" value=\"64\" size=\"5\"> temperature <input id=\"temp\" value=\"0.8\" "
    "size=\"4\"> API key <input id=\"key\" type=\"password\" size=\"12\"> <button id=\"go\">complete</button>\n"
    "<pre id=\"out\"></pre><div id=\"status\"></div>\n"
    "<h3>live tax (last 5 minutes)</h3><div class=\"row\"><span id=\"tax\"></span><span id=\"batch\"></span>"
    "<span id=\"tps\"></span><span id=\"kv\"></span></div>\n"
    "<canvas id=\"chart\" width=\"1000\" height=\"220\"></canvas>\n"
    "<div>phases stacked per second: <b style=\"color:#c33\">tax</b> (route dispatch load comm wait combine), "
    "<b style=\"color:#393\">work</b>; line: sequences per step</div>\n"
    "<script>\n"
    "const $=id=>document.getElementById(id);\n"
    "function hdrs(){const h={'Content-Type':'application/json'};const k=$('key').value;if(k)h.Authorization='Bearer '+k;return h}\n"
    "async function complete(){\n"
    " $('out').textContent='';$('status').textContent='streaming...';\n"
    " const body={prompt:$('prompt').value,max_tokens:+$('max').value,temperature:+$('temp').value,stream:true};\n"
    " try{const r=await fetch('/v1/completions',{method:'POST',headers:hdrs(),body:JSON.stringify(body)});\n"
    "  if(!r.ok){$('status').textContent='error '+r.status+': '+(await r.text());return}\n"
    "  const rd=r.body.getReader(),dec=new TextDecoder();let buf='',n=0;\n"
    "  for(;;){const{value,done}=await rd.read();if(done)break;buf+=dec.decode(value,{stream:true});let i;\n"
    "   while((i=buf.indexOf('\\n\\n'))>=0){const ev=buf.slice(0,i);buf=buf.slice(i+2);if(!ev.startsWith('data: '))continue;\n"
    "    const d=ev.slice(6);if(d==='[DONE]'){$('status').textContent='done: '+n+' chunks';$('out').dataset.done='1';continue}\n"
    "    const j=JSON.parse(d);if(j.error){$('status').textContent='error: '+j.error.message;continue}\n"
    "    if(j.choices&&j.choices.length){$('out').textContent+=j.choices[0].text||'';n++}}}\n"
    " }catch(e){$('status').textContent='error: '+e}}\n"
    "$('go').onclick=complete;\n"
    "const hist=[];let prev=null;\n"
    "function parse(t){const m={};for(const l of t.split('\\n')){if(!l||l[0]==='#')continue;const i=l.lastIndexOf(' ');"
    "m[l.slice(0,i)]=+l.slice(i+1)}return m}\n"
    "async function poll(){try{const r=await fetch('/metrics',{headers:hdrs()});if(!r.ok)return;const m=parse(await r.text());\n"
    " const ph={};for(const k in m){const x=k.match(/^moetax_phase_seconds_total\\{phase=\"(\\w+)\",tax=\"(\\w+)\"\\}/);"
    "if(x)ph[x[1]]={s:m[k],tax:x[2]==='true'}}\n"
    " const now=Date.now()/1000;if(prev){const dt=now-prev.t,p={t:now,ph:{},batch:m.moetax_batch_size,"
    "tps:(m['llamacpp:tokens_predicted_total']-prev.m['llamacpp:tokens_predicted_total'])/dt};\n"
    "  for(const k in ph)p.ph[k]={s:(ph[k].s-(prev.ph[k]?prev.ph[k].s:0))/dt,tax:ph[k].tax};hist.push(p);\n"
    "  while(hist.length&&hist[0].t<now-300)hist.shift();\n"
    "  $('tps').textContent=p.tps.toFixed(1)+' tokens/s'}\n"
    " prev={t:now,m:m,ph:ph};$('tax').textContent='tax share '+(100*m.moetax_tax_share).toFixed(1)+'%';\n"
    " $('batch').textContent='batch '+m.moetax_batch_size+' (mean '+(m.moetax_decode_batch_size_mean||0).toFixed(2)+')';\n"
    " $('kv').textContent='KV cells '+m.moetax_kv_cells_used+' / '+m.moetax_kv_cells;draw();\n"
    " document.body.dataset.polls=(+(document.body.dataset.polls||0)+1)}catch(e){}}\n"
    "function draw(){const c=$('chart'),g=c.getContext('2d'),W=c.width,H=c.height;g.clearRect(0,0,W,H);\n"
    " const w=W/300,now=Date.now()/1000;let maxb=1;for(const p of hist)maxb=Math.max(maxb,p.batch||0);\n"
    " for(const p of hist){const x=W-(now-p.t)*w;let y=H;const ks=Object.keys(p.ph).sort((a,b)=>p.ph[b].tax-p.ph[a].tax);\n"
    "  let i=0;for(const k of ks){const h=Math.min(1,p.ph[k].s)*H;g.fillStyle=p.ph[k].tax?`hsl(0,60%,${40+8*(i%5)}%)`:"
    "`hsl(120,45%,${30+6*(i%8)}%)`;g.fillRect(x,y-h,w+1,h);y-=h;i++}}\n"
    " g.strokeStyle='#225';g.beginPath();hist.forEach((p,i)=>{const x=W-(now-p.t)*w,y=H-(p.batch/maxb)*H*0.95;"
    "i?g.lineTo(x,y):g.moveTo(x,y)});g.stroke()}\n"
    "setInterval(poll,1000);poll();\n"
    "const q=new URLSearchParams(location.search);if(q.get('prompt')){$('prompt').value=q.get('prompt');"
    "if(q.get('max_tokens'))$('max').value=q.get('max_tokens');if(q.get('temperature'))$('temp').value=q.get('temperature');if(q.get('key'))$('key').value=q.get('key');complete()}\n"
    "</script></body></html>\n";

const char *srv_dashboard_html(size_t *len) {
    *len = sizeof page - 1;
    return page;
}
