// omni-serving playground: streams /v1/audio/speech (raw PCM16LE), chat
// completions, the text-in WebSocket or a realtime voice turn into Web Audio
// while it arrives.
// Plain script, no build step, same-origin requests only.
"use strict";

(() => {
  const DEFAULT_SAMPLE_RATE = 24000;
  const FALLBACK_MODEL = "omni-serving";
  const START_LEAD_S = 0.05; // scheduling head room when playback (re)starts
  const PEAK_BLOCK_S = 0.005; // one waveform column per 5 ms of audio
  const STREAM_ROUTE = "/v1/audio/speech/stream";
  const STREAM_PROTOCOL = "omni-speech-stream"; // the name the gateway echoes
  // A browser WebSocket cannot send Authorization: the key rides in a
  // subprotocol entry, as OpenAI's browser clients send it. It is a key
  // minted for this one connection, never the token itself.
  const KEY_PROTOCOL_PREFIX = "openai-insecure-api-key.";
  const KEY_SECONDS = 10; // the shortest the gateway mints: it only has to last until the handshake
  const REALTIME_ROUTE = "/v1/realtime";
  const REALTIME_PROTOCOL = "realtime";
  const VOICE_RATE = 24000; // the realtime session's PCM16 rate, both ways
  const APPEND_BYTES = 4800; // 100 ms of PCM16 a piece

  // Live figures, read by tests (and handy in the console).
  const live = {
    state: "idle", // idle | requesting | streaming | done | stopped | error
    samplesReceived: 0,
    bytesReceived: 0,
    ttfpMs: null,
    rtf: null,
    audioSeconds: 0,
    sampleRate: DEFAULT_SAMPLE_RATE,
    error: null,
    models: null, // the /v1/models list, or null when the server has none
    ready: false, // the model list (or its fallback) is loaded
    mode: "speech", // speech | chat | stream
    scheduledSeconds: 0, // audio handed to Web Audio
    transcript: "", // chat mode: the reply's text; stream mode: the segments spoken
    segments: 0, // stream mode: segments started
    protocol: null, // stream mode: the subprotocol the gateway echoed
    recording: false, // voice mode: the microphone is being recorded
    voiceSeconds: 0, // voice mode: the question recorded or picked
    sentAudio: null, // voice mode: the question as sent (base64 PCM16 24 kHz)
    responseId: null, // voice mode: the realtime response
    responseStatus: null, // voice mode: its status at response.done
  };
  window.playground = live;

  const $ = (id) => document.getElementById(id);
  const ui = {
    server: $("server"),
    mode: $("mode"),
    text: $("text"),
    model: $("model"),
    voiceSelect: $("voice-select"),
    voiceInput: $("voice-input"),
    voiceList: $("voice-list"),
    seed: $("seed"),
    token: $("token"),
    speak: $("speak"),
    stop: $("stop"),
    state: $("state"),
    error: $("error"),
    ttfp: $("ttfp"),
    rtf: $("rtf"),
    audioSeconds: $("audio-seconds"),
    samples: $("samples"),
    rate: $("rate"),
    canvas: $("waveform"),
    chatPanel: $("chat-panel"),
    transcriptLabel: $("transcript-label"),
    transcript: $("transcript"),
    textField: $("text-field"),
    voicePanel: $("voice-panel"),
    record: $("record"),
    voiceFile: $("voice-file"),
    voiceStatus: $("voice-status"),
    languageField: $("language-field"),
    language: $("language"),
    instructionsField: $("instructions-field"),
    instructions: $("instructions"),
    clonePanel: $("clone-panel"),
    cloneName: $("clone-name"),
    cloneTranscript: $("clone-transcript"),
    cloneFile: $("clone-file"),
    cloneRegister: $("clone-register"),
    cloneStatus: $("clone-status"),
  };

  // ---------------------------------------------------------------- PCM16LE
  // Network chunks split the byte stream anywhere, odd offsets included: an
  // odd trailing byte is kept and joined to the next chunk.
  class Pcm16Decoder {
    constructor() {
      this.carry = -1;
    }

    push(bytes) {
      let data = bytes;
      if (this.carry >= 0) {
        data = new Uint8Array(bytes.length + 1);
        data[0] = this.carry;
        data.set(bytes, 1);
        this.carry = -1;
      }
      const n = data.length >> 1;
      if (data.length & 1) this.carry = data[data.length - 1];
      const view = new DataView(data.buffer, data.byteOffset, n * 2);
      const out = new Float32Array(n);
      for (let i = 0; i < n; i++) out[i] = view.getInt16(2 * i, true) / 32768;
      return out;
    }

    get pendingBytes() {
      return this.carry >= 0 ? 1 : 0;
    }
  }

  // ------------------------------------------------------------ Web Audio
  let audioContext = null;

  function getAudioContext() {
    if (audioContext === null) {
      const Ctor = window.AudioContext || window.webkitAudioContext;
      if (!Ctor) return null;
      try {
        audioContext = new Ctor();
      } catch (err) {
        console.warn("no audio output:", err);
        return null;
      }
    }
    if (audioContext.state === "suspended") audioContext.resume().catch(() => {});
    return audioContext;
  }

  // Back-to-back AudioBufferSourceNodes, one per decoded chunk.
  class StreamPlayer {
    constructor(ctx, sampleRate) {
      this.ctx = ctx;
      this.sampleRate = sampleRate;
      this.nextTime = 0;
      this.sources = new Set();
    }

    // Schedules the samples right after the previous ones; returns their seconds.
    play(samples) {
      if (!this.ctx || samples.length === 0) return 0;
      const buffer = this.ctx.createBuffer(1, samples.length, this.sampleRate);
      buffer.copyToChannel(samples, 0);
      const source = this.ctx.createBufferSource();
      source.buffer = buffer;
      source.connect(this.ctx.destination);
      const now = this.ctx.currentTime;
      // First chunk, or the stream fell behind playback: restart with head room.
      if (this.nextTime < now) this.nextTime = now + START_LEAD_S;
      source.start(this.nextTime);
      this.nextTime += buffer.duration;
      this.sources.add(source);
      source.onended = () => this.sources.delete(source);
      return buffer.duration;
    }

    stop() {
      for (const source of this.sources) {
        try {
          source.stop();
        } catch (_) {
          // already stopped
        }
      }
      this.sources.clear();
    }
  }

  // ------------------------------------------------------------- waveform
  class Waveform {
    constructor(canvas) {
      this.canvas = canvas;
      this.reset(DEFAULT_SAMPLE_RATE);
    }

    reset(sampleRate) {
      this.block = Math.max(1, Math.round(sampleRate * PEAK_BLOCK_S));
      this.mins = [];
      this.maxs = [];
      this.curMin = 1;
      this.curMax = -1;
      this.curCount = 0;
      this.pending = false;
      this.draw();
    }

    push(samples) {
      for (let i = 0; i < samples.length; i++) {
        const v = samples[i];
        if (v < this.curMin) this.curMin = v;
        if (v > this.curMax) this.curMax = v;
        if (++this.curCount === this.block) this.flushBlock();
      }
      this.schedule();
    }

    finish() {
      if (this.curCount > 0) this.flushBlock();
      this.draw();
    }

    flushBlock() {
      this.mins.push(this.curMin);
      this.maxs.push(this.curMax);
      this.curMin = 1;
      this.curMax = -1;
      this.curCount = 0;
    }

    schedule() {
      if (this.pending) return;
      this.pending = true;
      requestAnimationFrame(() => {
        this.pending = false;
        this.draw();
      });
    }

    draw() {
      const canvas = this.canvas;
      const ratio = window.devicePixelRatio || 1;
      const width = Math.max(1, Math.round(canvas.clientWidth * ratio)) || canvas.width;
      const height = Math.max(1, Math.round(canvas.clientHeight * ratio)) || canvas.height;
      if (canvas.width !== width) canvas.width = width;
      if (canvas.height !== height) canvas.height = height;
      const g = canvas.getContext("2d");
      g.clearRect(0, 0, width, height);
      const mid = height / 2;
      g.fillStyle = "#d0d5dd";
      g.fillRect(0, Math.floor(mid), width, Math.max(1, Math.round(ratio)));
      const n = this.mins.length;
      if (n === 0) return;
      g.fillStyle = getComputedStyle(document.documentElement).getPropertyValue("--wave") || "#2f6fed";
      const columns = Math.min(width, n);
      const perColumn = n / columns;
      const columnWidth = width / columns;
      for (let c = 0; c < columns; c++) {
        const from = Math.floor(c * perColumn);
        const to = Math.max(from + 1, Math.floor((c + 1) * perColumn));
        let lo = 1;
        let hi = -1;
        for (let i = from; i < to; i++) {
          if (this.mins[i] < lo) lo = this.mins[i];
          if (this.maxs[i] > hi) hi = this.maxs[i];
        }
        const top = mid - hi * mid * 0.95;
        const bottom = mid - lo * mid * 0.95;
        g.fillRect(c * columnWidth, top, Math.max(1, columnWidth), Math.max(1, bottom - top));
      }
    }
  }

  const waveform = new Waveform(ui.canvas);
  live.Pcm16Decoder = Pcm16Decoder; // exposed for tests of the byte-boundary handling

  // ------------------------------------------------------------- display
  function setState(state) {
    live.state = state;
    ui.state.textContent = state;
    ui.state.dataset.state = state;
    const busy = state === "requesting" || state === "streaming";
    ui.speak.disabled = busy;
    ui.stop.disabled = !busy;
  }

  function showError(message) {
    live.error = message;
    ui.error.textContent = message;
    ui.error.hidden = false;
  }

  function clearError() {
    live.error = null;
    ui.error.textContent = "";
    ui.error.hidden = true;
  }

  function showFigures() {
    ui.ttfp.textContent = live.ttfpMs === null ? "–" : `${Math.round(live.ttfpMs)} ms`;
    ui.rtf.textContent = live.rtf === null ? "–" : live.rtf.toFixed(3);
    ui.audioSeconds.textContent = live.samplesReceived ? `${live.audioSeconds.toFixed(2)} s` : "–";
    ui.samples.textContent = String(live.samplesReceived);
    ui.rate.textContent = `${live.sampleRate} Hz`;
  }

  // OpenAI's error object, {"message", "type", "param", "code"}, as text.
  function errorObjectText(err) {
    const tags = [err.type, err.code, err.param && `param: ${err.param}`].filter(Boolean);
    return tags.length ? `${err.message}\n(${tags.join(", ")})` : err.message;
  }

  // An OpenAI-shaped error body, {"error": {...}}, as text.
  async function errorText(response) {
    const raw = await response.text();
    let detail = raw.slice(0, 500) || response.statusText;
    try {
      const err = JSON.parse(raw).error;
      if (err && typeof err.message === "string") detail = errorObjectText(err);
    } catch (_) {
      // not JSON: show the text as it is
    }
    return `HTTP ${response.status}: ${detail}`;
  }

  // A failure the server explained: its text is shown as it is.
  class ServerError extends Error {}

  function authHeaders() {
    const token = ui.token.value.trim();
    return token ? { Authorization: `Bearer ${token}` } : {};
  }

  // --------------------------------------------------------------- models
  function useVoiceText(voices) {
    ui.voiceSelect.hidden = true;
    ui.voiceInput.hidden = false;
    ui.voiceList.replaceChildren(...voices.map((v) => new Option(v, v)));
  }

  // A text-to-speech model's controls: its languages, style instructions,
  // and for a voice-clone model the registered voices and an upload.
  function showSpeechControls(model) {
    const languages = model && Array.isArray(model.languages) ? model.languages : [];
    ui.language.replaceChildren(new Option("auto", ""), ...languages.map((l) => new Option(l, l)));
    ui.languageField.hidden = languages.length === 0;
    ui.instructionsField.hidden = !(model && model.speech_instructions);
    ui.clonePanel.hidden = !(model && model.voice_registry);
  }

  async function registeredVoices() {
    const response = await fetch("/v1/audio/voices", { headers: authHeaders() });
    if (!response.ok) return [];
    const body = await response.json();
    return (Array.isArray(body.data) ? body.data : []).map((v) => v.name);
  }

  async function registerVoice() {
    const file = ui.cloneFile.files && ui.cloneFile.files[0];
    const name = ui.cloneName.value.trim();
    if (!file || !name) {
      ui.cloneStatus.textContent = "give a name and a clip";
      return;
    }
    const form = new FormData();
    form.append("name", name);
    form.append("transcript", ui.cloneTranscript.value.trim());
    form.append("audio", file, file.name);
    ui.cloneStatus.textContent = "registering…";
    const response = await fetch("/v1/audio/voices", { method: "POST", headers: authHeaders(), body: form });
    const body = await response.json().catch(() => ({}));
    if (!response.ok) {
      ui.cloneStatus.textContent = (body.error && body.error.message) || `failed (${response.status})`;
      return;
    }
    ui.cloneStatus.textContent = `registered ${body.name} (${Number(body.duration_seconds).toFixed(1)} s)`;
    await showModelVoices();
    ui.voiceSelect.value = body.name;
  }

  async function showModelVoices() {
    const model = (live.models || []).find((m) => m.id === ui.model.value);
    let voices = model && Array.isArray(model.voices) ? model.voices : [];
    showSpeechControls(model);
    if (model && model.voice_registry) voices = [...(await registeredVoices()), ...voices];
    if (model && Number.isInteger(model.sample_rate_hz)) live.sampleRate = model.sample_rate_hz;
    // Chat needs a model that writes text too.
    const chat = ui.mode.querySelector('option[value="chat"]');
    chat.disabled = Boolean(model && Array.isArray(model.modalities) && !model.modalities.includes("text"));
    chat.title = chat.disabled ? "this model produces no text" : "POST /v1/chat/completions";
    if (chat.disabled && ui.mode.value === "chat") {
      ui.mode.value = "speech";
      showMode();
    }
    // A voice turn needs a model that hears audio.
    const voiceTurn = ui.mode.querySelector('option[value="voice"]');
    const limits = model && model.limits;
    voiceTurn.disabled = Boolean(model && !(chat.disabled === false && limits && limits.max_input_audio_parts > 0));
    voiceTurn.title = voiceTurn.disabled ? "this model takes no audio input" : "WebSocket /v1/realtime";
    if (voiceTurn.disabled && ui.mode.value === "voice") {
      ui.mode.value = "speech";
      showMode();
    }
    if (voices.length === 0) {
      useVoiceText([]);
      return;
    }
    const keep = ui.voiceSelect.value;
    ui.voiceSelect.replaceChildren(...voices.map((v) => new Option(v, v)));
    if (voices.includes(keep)) ui.voiceSelect.value = keep;
    ui.voiceSelect.hidden = false;
    ui.voiceInput.hidden = true;
    showFigures();
  }

  // GET /v1/models; without it (404, older gateway), a free voice field
  // suggesting the voices /health reports, and the default sample rate.
  // The token may change while a load is under way (cleared, then typed):
  // only the latest load may change the page, whichever answer comes last.
  let modelLoads = 0;

  async function loadModels() {
    const load = ++modelLoads;
    try {
      await fetchModels(() => load === modelLoads);
    } finally {
      live.ready = true;
    }
  }

  async function fetchModels(latest) {
    let response;
    try {
      response = await fetch("/v1/models", { headers: authHeaders() });
    } catch (err) {
      if (latest()) ui.server.textContent = `server unreachable: ${err.message}`;
      return;
    }
    if (!latest()) return;
    if (response.ok) {
      const body = await response.json();
      if (!latest()) return;
      const models = (Array.isArray(body.data) ? body.data : []).filter(
        (m) => !Array.isArray(m.modalities) || m.modalities.includes("audio"),
      );
      if (models.length > 0) {
        live.models = models;
        const keep = ui.model.value;
        ui.model.replaceChildren(...models.map((m) => new Option(m.id, m.id)));
        if (models.some((m) => m.id === keep)) ui.model.value = keep;
        ui.model.disabled = models.length < 2;
        ui.server.textContent = `${models.length} model${models.length > 1 ? "s" : ""}`;
        await showModelVoices();
        return;
      }
    }
    live.models = null;
    ui.model.replaceChildren(new Option(FALLBACK_MODEL, FALLBACK_MODEL));
    ui.model.disabled = true;
    live.sampleRate = DEFAULT_SAMPLE_RATE;
    if (response.status === 401) {
      ui.server.textContent = "this server needs a token";
    } else {
      ui.server.textContent = response.ok ? "no speech model listed" : "no model list";
    }
    let voices = [];
    try {
      const health = await fetch("/health");
      const body = await health.json();
      if (!latest()) return;
      if (Array.isArray(body.voices)) voices = body.voices;
      if (!response.ok && response.status !== 401) {
        ui.server.textContent = `server ${body.status || health.status}`;
      }
    } catch (_) {
      // voices stay free text
    }
    useVoiceText(voices);
    showFigures();
  }

  function currentVoice() {
    return (ui.voiceSelect.hidden ? ui.voiceInput.value : ui.voiceSelect.value).trim();
  }

  // ---------------------------------------------------------------- speak
  let controller = null;
  let player = null;

  // JSON text of the request; a filled seed is spliced in as digits (a JS
  // number would round seeds above 2**53).
  function withSeed(body) {
    const json = JSON.stringify(body);
    const seed = ui.seed.value.trim();
    if (!seed) return json;
    if (!/^[0-9]{1,19}$/.test(seed)) throw new Error("seed: must be a non-negative integer");
    return `${json.slice(0, -1)},"seed":${seed.replace(/^0+(?=.)/, "")}}`;
  }

  function speechRequest() {
    const body = {
      model: ui.model.value || FALLBACK_MODEL,
      input: ui.text.value,
      response_format: "pcm",
      stream: true,
    };
    const voice = currentVoice();
    if (voice) body.voice = voice;
    if (!ui.languageField.hidden && ui.language.value) body.language = ui.language.value;
    const instructions = ui.instructions.value.trim();
    if (!ui.instructionsField.hidden && instructions) body.instructions = instructions;
    return { url: "/v1/audio/speech", body: withSeed(body) };
  }

  function chatRequest() {
    const body = {
      model: ui.model.value || FALLBACK_MODEL,
      messages: [{ role: "user", content: ui.text.value }],
      modalities: ["text", "audio"],
      audio: { format: "pcm16" },
      stream: true,
    };
    const voice = currentVoice();
    if (voice) body.audio.voice = voice;
    return { url: "/v1/chat/completions", body: withSeed(body) };
  }

  // The first message of a WebSocket call; the text follows it in pieces.
  function streamRequest() {
    const config = { type: "config", response_format: "pcm" };
    const voice = currentVoice();
    if (voice) config.voice = voice;
    return { config: withSeed(config), text: ui.text.value };
  }

  // Raw PCM16LE body: every network chunk is audio.
  async function readPcm(response, onAudio) {
    const reader = response.body.getReader();
    for (;;) {
      const { done, value } = await reader.read();
      if (done) return;
      if (value && value.length) onAudio(value);
    }
  }

  function base64Bytes(text) {
    const raw = atob(text);
    const bytes = new Uint8Array(raw.length);
    for (let i = 0; i < raw.length; i++) bytes[i] = raw.charCodeAt(i);
    return bytes;
  }

  // Server-sent chat.completion.chunk events: text deltas and base64 PCM16 audio.
  async function readChatEvents(response, onAudio, onText) {
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffered = "";
    for (;;) {
      const { done, value } = await reader.read();
      if (done) throw new Error("the event stream ended without [DONE]");
      buffered += value.replace(/\r\n?/g, "\n");
      let end;
      while ((end = buffered.indexOf("\n\n")) >= 0) {
        const event = buffered.slice(0, end);
        buffered = buffered.slice(end + 2);
        const data = event
          .split("\n")
          .filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).trimStart())
          .join("\n");
        if (!data) continue;
        if (data === "[DONE]") return;
        const chunk = JSON.parse(data);
        if (chunk.error) {
          const err = chunk.error;
          throw new Error(`${err.message}${err.code ? ` (${err.code})` : ""}`);
        }
        const delta = (chunk.choices && chunk.choices[0] && chunk.choices[0].delta) || {};
        if (typeof delta.content === "string") onText(delta.content);
        if (delta.audio) {
          if (typeof delta.audio.transcript === "string") onText(delta.audio.transcript);
          if (delta.audio.data) onAudio(base64Bytes(delta.audio.data));
        }
      }
    }
  }

  // POST a speech or chat request and play its stream; false when the server refused it.
  async function postAndPlay(request, chat, ctx, onAudio, onText) {
    const response = await fetch(request.url, {
      method: "POST",
      headers: { "Content-Type": "application/json", ...authHeaders() },
      body: request.body,
      signal: controller.signal,
    });
    if (!response.ok) throw new ServerError(await errorText(response));
    const rate = Number.parseInt(response.headers.get("X-Sample-Rate") || "", 10);
    live.sampleRate = Number.isInteger(rate) && rate > 0 ? rate : live.sampleRate;
    waveform.reset(live.sampleRate);
    player = new StreamPlayer(ctx, live.sampleRate);
    setState("streaming");
    if (chat) await readChatEvents(response, onAudio, onText);
    else await readPcm(response, onAudio);
  }

  // A key for one WebSocket connection, minted with the token the user typed
  // (POST /v1/realtime/client_secrets); null without a token.
  async function websocketKey() {
    if (!ui.token.value.trim()) return null;
    const response = await fetch("/v1/realtime/client_secrets", {
      method: "POST",
      headers: { "Content-Type": "application/json", ...authHeaders() },
      body: JSON.stringify({ expires_after: { anchor: "created_at", seconds: KEY_SECONDS } }),
      signal: controller.signal,
    });
    if (!response.ok) throw new ServerError(await errorText(response));
    return (await response.json()).value;
  }

  // GET /v1/audio/speech/stream: the config, the text word by word (as a
  // language model would write it), end; audio arrives per segment.
  async function streamAndPlay(request, ctx, onAudio, onText) {
    const key = await websocketKey();
    const protocols = key ? [STREAM_PROTOCOL, KEY_PROTOCOL_PREFIX + key] : [STREAM_PROTOCOL];
    const scheme = location.protocol === "https:" ? "wss:" : "ws:";
    const ws = new WebSocket(`${scheme}//${location.host}${STREAM_ROUTE}`, protocols);
    ws.binaryType = "arraybuffer";
    await new Promise((resolve, reject) => {
      let opened = false;
      let ended = false;
      let failure = null;
      const onAbort = () => {
        ws.close(1000);
        reject(new DOMException("stopped", "AbortError"));
      };
      controller.signal.addEventListener("abort", onAbort, { once: true });
      ws.onopen = () => {
        opened = true;
        live.protocol = ws.protocol;
        ws.send(request.config);
        for (const piece of request.text.match(/\S+\s*|\s+/g) || []) {
          ws.send(JSON.stringify({ type: "text", text: piece }));
        }
        ws.send(JSON.stringify({ type: "end" }));
      };
      ws.onmessage = (event) => {
        if (typeof event.data !== "string") {
          onAudio(new Uint8Array(event.data));
          return;
        }
        const message = JSON.parse(event.data);
        if (message.type === "ready") {
          live.sampleRate = message.sample_rate;
          waveform.reset(live.sampleRate);
          player = new StreamPlayer(ctx, live.sampleRate);
          setState("streaming");
        } else if (message.type === "segment.start") {
          live.segments += 1;
          onText((live.transcript ? " " : "") + message.text);
        } else if (message.type === "end") {
          ended = true;
        } else if (message.type === "error") {
          failure = `WebSocket error: ${errorObjectText(message.error)}`;
        }
      };
      ws.onclose = (event) => {
        controller.signal.removeEventListener("abort", onAbort);
        if (failure) reject(new ServerError(failure));
        else if (ended) resolve();
        else if (!opened) {
          // A browser hides the refused handshake's status and body.
          reject(new ServerError("the gateway refused the WebSocket: a wrong token, or a page from another origin"));
        } else reject(new Error(`the WebSocket closed (code ${event.code}) before the end`));
      };
    });
  }

  // ------------------------------------------------------------ voice turn
  // The question: microphone or file, as PCM16 at 24 kHz mono.
  let voicePcm = null;
  let recorder = null;

  function pcm16(samples) {
    const out = new Int16Array(samples.length);
    for (let i = 0; i < samples.length; i++) {
      const v = Math.max(-1, Math.min(1, samples[i]));
      out[i] = Math.round(v < 0 ? v * 32768 : v * 32767);
    }
    return out;
  }

  // Any AudioBuffer as mono at VOICE_RATE (the browser resamples and mixes down).
  async function atVoiceRate(buffer) {
    const offline = new OfflineAudioContext(1, Math.max(1, Math.ceil(buffer.duration * VOICE_RATE)), VOICE_RATE);
    const source = offline.createBufferSource();
    source.buffer = buffer;
    source.connect(offline.destination);
    source.start();
    return pcm16((await offline.startRendering()).getChannelData(0));
  }

  function setVoice(pcm, from) {
    voicePcm = pcm;
    live.voiceSeconds = pcm.length / VOICE_RATE;
    ui.voiceStatus.textContent = `${from}: ${live.voiceSeconds.toFixed(1)} s`;
  }

  async function toggleRecord() {
    if (recorder) {
      await stopRecording();
      return;
    }
    clearError();
    try {
      const stream = await navigator.mediaDevices.getUserMedia({ audio: true });
      const ctx = new AudioContext();
      const source = ctx.createMediaStreamSource(stream);
      const processor = ctx.createScriptProcessor(4096, 1, 1);
      const chunks = [];
      processor.onaudioprocess = (event) => {
        chunks.push(new Float32Array(event.inputBuffer.getChannelData(0)));
        live.voiceSeconds = (chunks.length * 4096) / ctx.sampleRate;
        ui.voiceStatus.textContent = `recording: ${live.voiceSeconds.toFixed(1)} s`;
      };
      source.connect(processor);
      processor.connect(ctx.destination); // (silent) a processor runs only when connected
      recorder = { stream, ctx, source, processor, chunks };
      live.recording = true;
      ui.record.textContent = "Stop recording";
      ui.record.dataset.recording = "true";
    } catch (err) {
      showError(`microphone: ${err.message}`);
    }
  }

  async function stopRecording() {
    const r = recorder;
    recorder = null;
    r.source.disconnect();
    r.processor.disconnect();
    for (const track of r.stream.getTracks()) track.stop();
    const n = r.chunks.reduce((total, c) => total + c.length, 0);
    const buffer = r.ctx.createBuffer(1, Math.max(1, n), r.ctx.sampleRate);
    let offset = 0;
    for (const c of r.chunks) {
      buffer.copyToChannel(c, 0, offset);
      offset += c.length;
    }
    await r.ctx.close();
    setVoice(await atVoiceRate(buffer), "recorded");
    live.recording = false;
    ui.record.textContent = "Record";
    ui.record.dataset.recording = "false";
  }

  async function pickFile() {
    const file = ui.voiceFile.files[0];
    if (!file) return;
    clearError();
    try {
      const decoded = await new OfflineAudioContext(1, 1, VOICE_RATE).decodeAudioData(await file.arrayBuffer());
      setVoice(await atVoiceRate(decoded), file.name);
    } catch (err) {
      showError(`${file.name}: this browser cannot read it as audio (${err.message})`);
    }
  }

  function bytesBase64(bytes) {
    let text = "";
    for (let i = 0; i < bytes.length; i += 0x8000) {
      text += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x8000));
    }
    return btoa(text);
  }

  function voiceRequest() {
    if (recorder) throw new Error("stop the recording first");
    if (!voicePcm) throw new Error("record a question or pick an audio file first");
    const output = {};
    const voice = currentVoice();
    if (voice) output.voice = voice;
    return {
      session: { type: "realtime", audio: { input: { turn_detection: null }, output } },
      pcm: new Uint8Array(voicePcm.buffer, voicePcm.byteOffset, voicePcm.byteLength),
    };
  }

  // GET /v1/realtime: one turn: the question appended and committed, then the
  // answer's audio and transcript as they come (OpenAI's Realtime events).
  async function realtimeAndPlay(request, ctx, onAudio, onText) {
    const key = await websocketKey();
    const protocols = key ? [REALTIME_PROTOCOL, KEY_PROTOCOL_PREFIX + key] : [REALTIME_PROTOCOL];
    const scheme = location.protocol === "https:" ? "wss:" : "ws:";
    const ws = new WebSocket(`${scheme}//${location.host}${REALTIME_ROUTE}`, protocols);
    await new Promise((resolve, reject) => {
      let opened = false;
      let done = false;
      let failure = null;
      const onAbort = () => {
        ws.close(1000); // the gateway cancels the answer
        reject(new DOMException("stopped", "AbortError"));
      };
      controller.signal.addEventListener("abort", onAbort, { once: true });
      ws.onopen = () => {
        opened = true;
        live.protocol = ws.protocol;
        ws.send(JSON.stringify({ type: "session.update", session: request.session }));
        for (let i = 0; i < request.pcm.length; i += APPEND_BYTES) {
          const audio = bytesBase64(request.pcm.subarray(i, i + APPEND_BYTES));
          ws.send(JSON.stringify({ type: "input_audio_buffer.append", audio }));
        }
        live.sentAudio = bytesBase64(request.pcm);
        ws.send(JSON.stringify({ type: "input_audio_buffer.commit" }));
        ws.send(JSON.stringify({ type: "response.create" }));
      };
      ws.onmessage = (event) => {
        const message = JSON.parse(event.data);
        if (message.type === "response.created") {
          live.responseId = message.response.id;
          live.sampleRate = VOICE_RATE;
          waveform.reset(VOICE_RATE);
          player = new StreamPlayer(ctx, VOICE_RATE);
          setState("streaming");
        } else if (message.type === "response.output_audio.delta") {
          onAudio(base64Bytes(message.delta));
        } else if (message.type === "response.output_audio_transcript.delta") {
          onText(message.delta);
        } else if (message.type === "response.done") {
          live.responseStatus = message.response.status;
          done = true;
          ws.close(1000);
        } else if (message.type === "error") {
          failure = `realtime error: ${errorObjectText(message.error)}`;
          ws.close(1000);
        }
      };
      ws.onclose = (event) => {
        controller.signal.removeEventListener("abort", onAbort);
        if (failure) reject(new ServerError(failure));
        else if (done) resolve();
        else if (!opened) {
          reject(new ServerError("the gateway refused the WebSocket: a wrong token, or a page from another origin"));
        } else reject(new Error(`the WebSocket closed (code ${event.code}) before the answer ended`));
      };
    });
  }

  async function speak() {
    if (controller) return;
    clearError();
    const mode = ui.mode.value;
    let request;
    try {
      const requests = { chat: chatRequest, stream: streamRequest, voice: voiceRequest, speech: speechRequest };
      request = requests[mode]();
    } catch (err) {
      showError(err.message);
      setState("error");
      return;
    }
    Object.assign(live, {
      mode,
      samplesReceived: 0,
      bytesReceived: 0,
      ttfpMs: null,
      rtf: null,
      audioSeconds: 0,
      scheduledSeconds: 0,
      transcript: "",
      segments: 0,
      protocol: null,
      sentAudio: null,
      responseId: null,
      responseStatus: null,
    });
    ui.transcript.textContent = "";
    const started = performance.now();
    const ctx = getAudioContext(); // inside the click: allowed to start audio
    controller = new AbortController();
    setState("requesting");
    showFigures();
    waveform.reset(live.sampleRate);
    const decoder = new Pcm16Decoder();
    const onAudio = (bytes) => {
      const now = performance.now();
      if (live.ttfpMs === null) live.ttfpMs = now - started;
      live.bytesReceived += bytes.length;
      const samples = decoder.push(bytes);
      live.samplesReceived += samples.length;
      live.audioSeconds = live.samplesReceived / live.sampleRate;
      if (live.audioSeconds > 0) live.rtf = (now - started) / 1000 / live.audioSeconds;
      live.scheduledSeconds += player.play(samples);
      waveform.push(samples);
      showFigures();
    };
    const onText = (text) => {
      live.transcript += text;
      ui.transcript.textContent = live.transcript;
    };
    try {
      if (mode === "stream") await streamAndPlay(request, ctx, onAudio, onText);
      else if (mode === "voice") await realtimeAndPlay(request, ctx, onAudio, onText);
      else await postAndPlay(request, mode === "chat", ctx, onAudio, onText);
      waveform.finish();
      if (decoder.pendingBytes) showError("the stream ended in the middle of a sample (odd byte count)");
      setState("done");
    } catch (err) {
      waveform.finish();
      if (err.name === "AbortError") {
        setState("stopped");
      } else if (err instanceof ServerError) {
        showError(err.message);
        setState("error");
      } else {
        // Once audio has started, the server signals a failure by cutting the stream.
        const where = live.samplesReceived ? ` after ${live.samplesReceived} samples` : "";
        showError(`stream failed${where}: ${err.message}`);
        setState("error");
      }
    } finally {
      controller = null;
      showFigures();
    }
  }

  function stop() {
    if (controller) controller.abort();
    if (player) player.stop();
  }

  function showMode() {
    const voice = ui.mode.value === "voice";
    ui.chatPanel.hidden = ui.mode.value === "speech";
    ui.transcriptLabel.textContent = ui.mode.value === "stream" ? "Segments spoken" : "Reply";
    ui.textField.hidden = voice;
    ui.voicePanel.hidden = !voice;
    ui.seed.parentElement.hidden = voice; // a realtime session takes no seed
  }

  ui.speak.addEventListener("click", speak);
  ui.stop.addEventListener("click", stop);
  ui.mode.addEventListener("change", showMode);
  ui.record.addEventListener("click", toggleRecord);
  ui.voiceFile.addEventListener("change", pickFile);
  ui.model.addEventListener("change", showModelVoices);
  ui.cloneRegister.addEventListener("click", registerVoice);
  ui.token.addEventListener("change", loadModels);
  ui.text.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) speak();
  });
  window.addEventListener("resize", () => waveform.draw());

  setState("idle");
  showMode();
  showFigures();
  loadModels();
})();
