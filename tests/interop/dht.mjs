// A js-libp2p Kademlia DHT server (@libp2p/kad-dht, /ipfs/kad/1.0.0) on 127.0.0.1, for tests/test_rendezvous.py: the
// independent implementation among the DHT servers that stand in for the public DHT.
//
// It listens on 127.0.0.1 (or the --listen address: a lab namespace's), dials only addresses on its own /8 (the
// peers it is given, those they name), and speaks TCP + Noise + yamux, as a public DHT server does. It prints one
// JSON line with its full multiaddr once listening, and runs until SIGTERM/SIGINT or its time limit.
//
// With --relay it is also a limited circuit relay v2 server (@libp2p/circuit-relay-v2), as a public DHT server run by
// kubo is: the public peer that is not a sapo node. Limits are kubo's defaults for its relay service (a reservation
// lasts an hour, at most 128 of them and 8 from one IP address, 16 circuits to one peer; each circuit 2 minutes and
// 128 KiB), except that js-libp2p counts a circuit's bytes in both directions against one budget (go-libp2p: each
// direction), has no per-ASN limit, and tells clients the duration in milliseconds where the spec says seconds
// (limit.duration 120000). --circuit-seconds, --circuit-bytes and --reservation-seconds shorten them for tests.
//
//   node dht.mjs --seconds 300 [--listen /ip4/IP/tcp/PORT] [--peer /ip4/127.0.0.1/tcp/PORT/p2p/ID ...]
//                [--relay [--circuit-seconds 120] [--circuit-bytes 131072] [--reservation-seconds 3600]]
import './polyfill.mjs'
import { parseArgs } from 'node:util'
import { noise } from '@chainsafe/libp2p-noise'
import { yamux } from '@chainsafe/libp2p-yamux'
import { circuitRelayServer } from '@libp2p/circuit-relay-v2'
import { identify } from '@libp2p/identify'
import { kadDHT } from '@libp2p/kad-dht'
import { ping } from '@libp2p/ping'
import { tcp } from '@libp2p/tcp'
import { multiaddr } from '@multiformats/multiaddr'
import { createLibp2p } from 'libp2p'

const { values: args } = parseArgs({
  options: {
    seconds: { type: 'string' },
    listen: { type: 'string', default: '/ip4/127.0.0.1/tcp/0' },
    peer: { type: 'string', multiple: true, default: [] },
    relay: { type: 'boolean', default: false },
    'circuit-seconds': { type: 'string', default: '120' },  // kubo: Swarm.RelayService.ConnectionDurationLimit
    'circuit-bytes': { type: 'string', default: String(128 << 10) },  // kubo: ConnectionDataLimit (per direction there)
    'reservation-seconds': { type: 'string', default: '3600' }  // kubo: ReservationTTL
  }
})
const seconds = Number(args.seconds)
if (!(seconds > 0)) {
  process.stdout.write(JSON.stringify({ event: 'error', message: '--seconds must be positive' }) + '\n')
  process.exit(2)
}

const RESERVATIONS = 128  // kubo: Swarm.RelayService.MaxReservations
const RESERVATIONS_PER_IP = 8  // kubo: MaxReservationsPerIP
const CIRCUITS_PER_PEER = 16  // kubo: MaxCircuits, open circuits to one reserving peer (here: its STOP streams)

const ipOf = (ma) => ma.toString().split('/')[2]
// kubo's per-IP limit, which js-libp2p's relay lacks: a reservation (or its renewal) is refused, PERMISSION_DENIED,
// when other peers at the asker's IP address hold RESERVATIONS_PER_IP
const denyInboundRelayReservation = (peer) => {
  const ip = ipOf(node.getConnections(peer)[0].remoteAddr)
  let held = 0
  for (const [other, reservation] of node.services.relay.reservations) {
    held += !other.equals(peer) && ipOf(reservation.addr) === ip
  }
  return held >= RESERVATIONS_PER_IP
}
const relay = {
  relay: circuitRelayServer({
    maxOutboundStopStreams: CIRCUITS_PER_PEER,
    reservations: {
      maxReservations: RESERVATIONS,
      reservationTtl: Number(args['reservation-seconds']) * 1000,
      defaultDurationLimit: Number(args['circuit-seconds']) * 1000,
      defaultDataLimit: BigInt(args['circuit-bytes'])
    }
  })
}

const own = args.listen.split('/')[2].split('.')[0]  // the first octet of its address: the lab's, or loopback
const node = await createLibp2p({
  addresses: { listen: [args.listen] },
  transports: [tcp()],
  connectionEncrypters: [noise()],
  streamMuxers: [yamux()],
  connectionGater: {
    denyDialMultiaddr: (ma) => !ma.toString().startsWith(`/ip4/${own}.`),
    ...(args.relay ? { denyInboundRelayReservation } : {})
  },
  services: {
    identify: identify(),
    ping: ping(),
    // a server from the start (no waiting to learn it is public), and private addresses kept: the lab's are
    dht: kadDHT({ protocol: '/ipfs/kad/1.0.0', clientMode: false, peerInfoMapper: (info) => info }),
    ...(args.relay ? relay : {})
  }
})
for (const peer of args.peer) {
  await node.dial(multiaddr(peer))
}
process.stdout.write(JSON.stringify({ event: 'listening', addr: node.getMultiaddrs()[0].toString() }) + '\n')

const stop = async () => { await node.stop(); process.exit(0) }
process.on('SIGTERM', stop)
process.on('SIGINT', stop)
setTimeout(stop, seconds * 1000)
