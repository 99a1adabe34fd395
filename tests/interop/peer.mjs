// A js-libp2p peer speaking sapo wire protocol 3 (docs/PROTOCOL.md) to one sapo node, for tests/test_interop.py.
//
// It dials only the bootstrap address it is given (a connection gater refuses every other dial), listens on
// 127.0.0.1 only, and uses TCP + Noise + yamux + GossipSub with StrictSign, as section 1 requires. It publishes
// valid rollout messages built from the task references it is given (with their right answers), one invalid
// message per requested rejection reason (section 4), and reports every rollout it receives after checking it.
// One JSON line per event on stdout; it exits by itself at its time limit, or on SIGTERM/SIGINT.
//
//   node peer.mjs --bootstrap /ip4/127.0.0.1/tcp/PORT/p2p/ID --seconds 120 --level 1 \
//        --tasks '[{"dataset":"arith","config":{},"seed":0,"index":3,"answer":"12"}]' --invalid version,too_old
import './polyfill.mjs'
import { createHash } from 'node:crypto'
import { parseArgs } from 'node:util'
import { noise } from '@chainsafe/libp2p-noise'
import { yamux } from '@chainsafe/libp2p-yamux'
import { generateKeyPair } from '@libp2p/crypto/keys'
import { gossipsub, StrictSign } from '@libp2p/gossipsub'
import { identify } from '@libp2p/identify'
import { peerIdFromPrivateKey, peerIdFromString } from '@libp2p/peer-id'
import { tcp } from '@libp2p/tcp'
import { decode, encode } from '@msgpack/msgpack'
import { multiaddr } from '@multiformats/multiaddr'
import { createLibp2p } from 'libp2p'

const VERSION = 3
const MAX_LEVEL = 24
const MAX_CLOCK_SKEW_S = 30 // section 4, step 0: epochs of now +- the receiver's skew are accepted
const STALE_S = 3600 // far past the 300 s age limit and the 30 s future limit (section 3, limits)
const GRIND_TRIES = 10000 // landing in the node's shard at level L takes about 2^L key generations
const REASONS = ['version', 'sender_mismatch', 'no_signal', 'too_old', 'from_future', 'wrong_shard']

const { values: args } = parseArgs({
  options: {
    bootstrap: { type: 'string' },
    seconds: { type: 'string' },
    'topic-base': { type: 'string', default: '/sapo/local/rollouts/3' },
    'epoch-s': { type: 'string', default: '1800' },
    level: { type: 'string', default: '0' }, // the shard level the node reads (pinned there)
    tasks: { type: 'string', default: '[]' },
    invalid: { type: 'string', default: '' },
    'interval-s': { type: 'string', default: '1' },
    model: { type: 'string', default: 'js-libp2p-interop' }
  }
})

function emit (event) {
  process.stdout.write(JSON.stringify({ t: Date.now() / 1000, ...event }) + '\n')
}

function fail (message) {
  emit({ event: 'error', message })
  process.exit(2)
}

if (args.bootstrap == null || args.seconds == null) fail('--bootstrap and --seconds are required')
const seconds = Number(args.seconds)
const epochS = Number(args['epoch-s'])
const level = Number(args.level)
const intervalMs = Number(args['interval-s']) * 1000
if (!(seconds > 0) || !(epochS > 0) || !(intervalMs > 0)) fail('--seconds, --epoch-s and --interval-s must be positive')
if (!Number.isInteger(level) || level < 0 || level > MAX_LEVEL) fail(`--level must be 0..${MAX_LEVEL}`)
const tasks = JSON.parse(args.tasks)
const invalid = args.invalid.split(',').filter(Boolean)
const unknown = invalid.filter(r => !REASONS.includes(r))
if (unknown.length > 0) fail(`unknown --invalid reasons: ${unknown.join(',')} (known: ${REASONS.join(',')})`)
if (tasks.length === 0) fail('--tasks needs at least one task reference with its answer')
if (invalid.includes('wrong_shard') && level === 0) fail('wrong_shard needs --level 1 or more: level 0 is every author\'s shard')

const started = Date.now()
const deadline = started + seconds * 1000
// The last resort: whatever hangs (a stop that never returns), the process ends near its time limit.
setTimeout(() => { emit({ event: 'stopped', reason: 'hard_limit' }); process.exit(3) }, seconds * 1000 + 5000)

const bootstrap = multiaddr(args.bootstrap)
const parts = Object.fromEntries(bootstrap.getComponents().map(c => [c.name, c.value]))
if (parts.ip4 !== '127.0.0.1' || parts.tcp == null || parts.p2p == null) {
  fail('--bootstrap must be /ip4/127.0.0.1/tcp/PORT/p2p/PEER_ID')
}
const nodeId = peerIdFromString(parts.p2p)

let stopRequested
const stopping = new Promise(resolve => { stopRequested = resolve })
let stopReason = null
for (const sig of ['SIGTERM', 'SIGINT']) {
  process.on(sig, () => { stopReason ??= sig; stopRequested() })
}

/** Waits `ms`, less when a stop is requested. */
function sleep (ms) {
  return Promise.race([new Promise(resolve => setTimeout(resolve, Math.max(0, ms))), stopping])
}

function running () {
  return stopReason == null && Date.now() < deadline
}

/** Section 7: sha256("sapo-shard/" + decimal epoch + "/" + peer id bytes). */
function shardKey (peerId, epoch) {
  return createHash('sha256').update(`sapo-shard/${epoch}/`, 'ascii').update(peerId.toMultihash().bytes).digest()
}

/** The first `bits` bits of a shard key as '0'/'1' characters, most significant bit of the first byte first. */
function prefix (key, bits) {
  let out = ''
  for (let i = 0; i < bits; i++) out += (key[i >> 3] >> (7 - (i & 7))) & 1
  return out
}

function epochAt (unixSeconds) {
  return Math.floor(unixSeconds / epochS)
}

function shardTopic (peerId, lv, epoch) {
  return `${args['topic-base']}/s${prefix(shardKey(peerId, epoch), lv)}`
}

const epoch = epochAt(started / 1000)
const nodeShard = prefix(shardKey(nodeId, epoch), level)
const topic = `${args['topic-base']}/s${nodeShard}` // the topic the node reads (its shard at `level`)

/** An Ed25519 key whose shard at `level` is (or, with inShard false, is not) the node's, this epoch. */
async function keyFor (inShard) {
  for (let i = 0; i < GRIND_TRIES; i++) {
    const key = await generateKeyPair('Ed25519')
    if ((prefix(shardKey(peerIdFromPrivateKey(key), epoch), level) === nodeShard) === inShard) return key
  }
  fail(`no key ${inShard ? 'in' : 'outside'} shard ${nodeShard} after ${GRIND_TRIES} tries`)
}

/** Refuses every dial but the bootstrap address and peer: this peer never reaches anywhere else. */
const gater = {
  denyDialPeer: peerId => !peerId.equals(nodeId),
  denyDialMultiaddr: ma => {
    const c = Object.fromEntries(ma.getComponents().map(x => [x.name, x.value]))
    return c.ip4 !== parts.ip4 || c.tcp !== parts.tcp
  }
}

function startPeer (privateKey) {
  return createLibp2p({
    privateKey,
    addresses: { listen: ['/ip4/127.0.0.1/tcp/0'] },
    transports: [tcp()],
    connectionEncrypters: [noise()],
    streamMuxers: [yamux()],
    connectionGater: gater,
    services: {
      identify: identify(),
      // the sapo reference's recommended parameters (section 1); StrictSign is gossipsub's default, said aloud
      pubsub: gossipsub({ globalSignaturePolicy: StrictSign, D: 4, Dlo: 3, Dhi: 8, heartbeatInterval: 1000 })
    }
  })
}

/** Dials the bootstrap peer until connected; false at the time limit. */
async function connect (peer) {
  while (running()) {
    try {
      await peer.dial(bootstrap, { signal: AbortSignal.timeout(5000) })
      return true
    } catch (e) {
      emit({ event: 'dial_failed', by: peer.peerId.toString(), error: String(e?.message ?? e) })
      await sleep(500)
    }
  }
  return false
}

/** Waits until the node has told `peer` it reads `topic`; false at the time limit. */
async function nodeReads (peer) {
  while (running()) {
    if (peer.services.pubsub.getSubscribers(topic).some(p => p.equals(nodeId))) return true
    await sleep(100)
  }
  return false
}

function completion (answer) {
  return `<answer>${answer}</answer>`
}

/** One rollout group with signal: two right answers and two different wrong ones (or, `uniform`, all right). */
function group (task, uniform = false) {
  const right = completion(task.answer)
  const completions = uniform
    ? [right, right, right, right]
    : [right, completion(`${task.answer}1`), right, completion(`${task.answer}2`)]
  return { dataset: task.dataset, config: task.config, seed: task.seed, index: task.index, completions }
}

/** A section 3 message by `author`; `override` changes fields to break exactly one rule. */
function message (author, round, task, override = {}) {
  return {
    v: VERSION,
    peer: author.toString(),
    model: args.model,
    round,
    created: Date.now() / 1000,
    groups: [group(task)],
    ...override
  }
}

/** The message that the node must reject with `reason`, and who signs it. */
function invalidMessage (reason, author, stranger, round, task) {
  const now = Date.now() / 1000
  switch (reason) {
    case 'version': return [author, message(author.peerId, round, task, { v: 2 })]
    case 'sender_mismatch': return [author, message(author.peerId, round, task, { peer: nodeId.toString() })]
    case 'no_signal': return [author, message(author.peerId, round, task, { groups: [group(task, true)] })]
    case 'too_old': return [author, message(author.peerId, round, task, { created: now - STALE_S })]
    case 'from_future': return [author, message(author.peerId, round, task, { created: now + STALE_S })]
    case 'wrong_shard': return [stranger, message(stranger.peerId, round, task)] // signed outside the node's shard
  }
}

async function publish (peer, kind, msg) {
  try {
    const { recipients } = await peer.services.pubsub.publish(topic, encode(msg))
    emit({ event: 'published', kind, by: peer.peerId.toString(), topic, round: msg.round, created: msg.created,
      recipients: recipients.map(String), task: { ...msg.groups[0], completions: undefined } })
  } catch (e) {
    emit({ event: 'publish_failed', kind, by: peer.peerId.toString(), topic, error: String(e?.message ?? e) })
  }
}

/** Why a received rollout is not a valid protocol 3 message from its signer on its signer's shard, or null. */
function problem (msg, payload) {
  if (msg.type !== 'signed') return 'unsigned'
  if (payload?.v !== VERSION) return `v is ${payload?.v}`
  if (payload.peer !== msg.from.toString()) return `peer ${payload.peer} is not the signer ${msg.from}`
  if (!Array.isArray(payload.groups) || payload.groups.length === 0) return 'no groups'
  const head = `${args['topic-base']}/s`
  if (!msg.topic.startsWith(head)) return `${msg.topic} is not a rollout topic of this network`
  const lv = msg.topic.length - head.length
  const now = Date.now() / 1000
  const epochs = new Set([epochAt(now - MAX_CLOCK_SKEW_S), epochAt(now), epochAt(now + MAX_CLOCK_SKEW_S)])
  if (![...epochs].some(e => shardTopic(msg.from, lv, e) === msg.topic)) return `${msg.topic} is not the signer's shard`
  return null
}

function report (evt) {
  const { msg, msgId } = evt.detail
  let payload = null
  let error = null
  try {
    payload = decode(msg.data)
  } catch (e) {
    error = `undecodable: ${e?.message ?? e}`
  }
  const why = error ?? problem(msg, payload)
  emit({
    event: 'received',
    from: msg.type === 'signed' ? msg.from.toString() : null,
    topic: msg.topic,
    valid: why == null,
    problem: why,
    v: payload?.v ?? null,
    peer: payload?.peer ?? null,
    round: payload?.round ?? null,
    created: payload?.created ?? null,
    groups: Array.isArray(payload?.groups) ? payload.groups.length : null,
    datasets: Array.isArray(payload?.groups) ? [...new Set(payload.groups.map(g => g?.dataset))] : null,
    seqno: msg.type === 'signed' ? msg.sequenceNumber.toString(16).padStart(16, '0') : null,
    msg_id: msgId
  })
}

async function main () {
  const author = await startPeer(await keyFor(true))
  const stranger = invalid.includes('wrong_shard') ? await startPeer(await keyFor(false)) : null
  const peers = stranger ? [author, stranger] : [author]
  let code = 0
  try {
    author.services.pubsub.addEventListener('gossipsub:message', report)
    // The node publishes at levels L-1, L and L+1 of its shard: this peer shares the first two.
    const reads = [...new Set([shardTopic(nodeId, Math.max(0, level - 1), epoch), topic])]
    for (const t of reads) author.services.pubsub.subscribe(t)
    emit({ event: 'ready', peer: author.peerId.toString(), stranger: stranger?.peerId.toString() ?? null,
      addrs: author.getMultiaddrs().map(String), epoch, node_shard_key: shardKey(nodeId, epoch).toString('hex'), level,
      topic, subscribed: reads })
    for (const peer of peers) {
      if (!(await connect(peer)) || !(await nodeReads(peer))) return
      emit({ event: 'node_subscribed', by: peer.peerId.toString(), topic })
    }
    let round = 0
    for (const task of tasks) {
      if (!running()) break
      await publish(author, 'valid', message(author.peerId, ++round, task))
      if (round === 2) { // the node has had valid messages first: then each invalid one once
        for (const reason of invalid) {
          const [signer, msg] = invalidMessage(reason, author, stranger, ++round, task)
          await publish(signer, reason, msg)
        }
      }
      await sleep(intervalMs)
    }
    while (running()) await sleep(deadline - Date.now()) // keep receiving until the limit or a stop
  } catch (e) {
    emit({ event: 'error', message: String(e?.stack ?? e) })
    code = 2
  } finally {
    await Promise.race([Promise.all(peers.map(p => p.stop())), new Promise(resolve => setTimeout(resolve, 3000))])
    emit({ event: 'stopped', reason: stopReason ?? 'time_limit' })
    process.exit(code)
  }
}

main().catch(e => fail(String(e?.stack ?? e)))
